//! What a configuration reload (`SIGHUP`) changes, as pure functions over the running and
//! the reloaded configuration; the pool actor applies the result ([`crate::pool`]).
//!
//! Reloadable: the models (`[[model]]`, `models_dir`, `--model`), all of `[pool]`, the
//! `[server]` settings an engine is launched with (`engine_bin`, `engine_args`, `engine_env`,
//! `engine_options`, `limits`), and who may talk to mlxd (`api_keys`, `api_key_file` and its
//! contents, `admin_api_key`, `allowed_origins`, `allowed_hosts`), so that a rotated key
//! stops working at the reload. A changed model keeps its running engine; the new settings
//! apply at its next load. Every other `[server]` setting (the listener, timeouts) is kept as
//! it runs, and named in the log: it takes a restart of `mlxd`.

use crate::catalog::{Catalog, ModelEntry};
use crate::config::{Config, ServerConfig};

/// The difference between two catalogs, by model id.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReloadPlan {
    /// Configured now, not before: servable once applied (pinned ones start).
    pub added: Vec<String>,
    /// Configured before, not now: drained (in-flight requests finish), stopped, gone.
    pub removed: Vec<String>,
    /// In both, with different settings.
    pub changed: Vec<ModelChange>,
    /// The default model, when it changed: `(before, now)`.
    pub default_model: Option<(String, String)>,
}

/// A model whose settings differ, and which.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelChange {
    pub id: String,
    /// Names of the settings that differ (`source`, `aliases`, `pinned`, `ttl`, `limits`,
    /// `options`, `memory`).
    pub fields: Vec<&'static str>,
}

impl ReloadPlan {
    pub fn is_empty(&self) -> bool {
        self.added.is_empty()
            && self.removed.is_empty()
            && self.changed.is_empty()
            && self.default_model.is_none()
    }
}

/// What changes from `old` to `new`, models in the order of `new` (removed ones in the order
/// of `old`).
pub fn plan(old: &Catalog, new: &Catalog) -> ReloadPlan {
    let mut out = ReloadPlan::default();
    for m in &new.models {
        match old.models.iter().find(|o| o.id == m.id) {
            None => out.added.push(m.id.clone()),
            Some(o) => {
                let fields = changed_fields(o, m);
                if !fields.is_empty() {
                    out.changed.push(ModelChange {
                        id: m.id.clone(),
                        fields,
                    });
                }
            }
        }
    }
    out.removed = old
        .models
        .iter()
        .filter(|o| !new.models.iter().any(|m| m.id == o.id))
        .map(|o| o.id.clone())
        .collect();
    if old.default_model != new.default_model {
        out.default_model = Some((old.default_model.clone(), new.default_model.clone()));
    }
    out
}

/// The settings of one model that differ between `old` and `new`.
pub fn changed_fields(old: &ModelEntry, new: &ModelEntry) -> Vec<&'static str> {
    let mut fields = Vec::new();
    let mut check = |name, differs: bool| {
        if differs {
            fields.push(name);
        }
    };
    check("source", old.source != new.source);
    check("aliases", old.aliases != new.aliases);
    check("pinned", old.pinned != new.pinned);
    check("ttl", old.ttl != new.ttl);
    check("standby", old.standby != new.standby);
    check("limits", old.limits != new.limits);
    check("options", old.options != new.options);
    check("memory", old.planned_bytes != new.planned_bytes);
    fields
}

/// The configuration to run after a reload: `reloaded`, except for the `[server]` settings
/// that cannot change while `mlxd` runs, which keep their `running` values. Returns it with
/// the names of those settings that the reloaded file changed (to be logged: they take a
/// restart).
pub fn merge(running: &Config, reloaded: Config) -> (Config, Vec<&'static str>) {
    let new = &reloaded.server;
    let old = &running.server;
    // Every field is named here, so that a new `[server]` setting cannot be forgotten: the
    // compiler refuses this pattern until it is added below, as reloadable or kept.
    let ServerConfig {
        host: _,
        port: _,
        engine_bin: _,
        engine_args: _,
        engine_env: _,
        engine_options: _,
        limits: _,
        runtime_dir: _,
        max_body_bytes: _,
        queue_capacity: _,
        queue_timeout_ms: _,
        backoff_initial_ms: _,
        backoff_max_ms: _,
        crash_limit: _,
        crash_window_ms: _,
        failed_cooldown_ms: _,
        limits_recovery_ms: _,
        grace_ms: _,
        header_timeout_ms: _,
        body_timeout_ms: _,
        max_connections: _,
        max_connections_per_client: _,
        max_in_flight_per_model: _,
        max_tokens_limit: _,
        load_timeout_ms: _,
        hang_timeout_ms: _,
        max_resumes: _,
        api_keys: _,
        api_key_file: _,
        admin_api_key: _,
        allowed_origins: _,
        allowed_hosts: _,
    } = new;
    let mut kept = Vec::new();
    macro_rules! keep {
        ($($field:ident),* $(,)?) => {
            $( if old.$field != new.$field { kept.push(stringify!($field)); } )*
        };
    }
    keep!(
        host,
        port,
        runtime_dir,
        max_body_bytes,
        queue_capacity,
        queue_timeout_ms,
        backoff_initial_ms,
        backoff_max_ms,
        crash_limit,
        crash_window_ms,
        failed_cooldown_ms,
        limits_recovery_ms,
        grace_ms,
        header_timeout_ms,
        body_timeout_ms,
        max_connections,
        max_connections_per_client,
        max_in_flight_per_model,
        max_tokens_limit,
        load_timeout_ms,
        hang_timeout_ms,
        max_resumes,
    );
    let server = ServerConfig {
        engine_bin: new.engine_bin.clone(),
        engine_args: new.engine_args.clone(),
        engine_env: new.engine_env.clone(),
        engine_options: new.engine_options.clone(),
        limits: new.limits.clone(),
        api_keys: new.api_keys.clone(),
        api_key_file: new.api_key_file.clone(),
        admin_api_key: new.admin_api_key.clone(),
        allowed_origins: new.allowed_origins.clone(),
        allowed_hosts: new.allowed_hosts.clone(),
        ..old.clone()
    };
    (Config { server, ..reloaded }, kept)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn catalog(text: &str) -> Catalog {
        Catalog::from_config(&Config::from_toml_str(text, "t.toml").unwrap()).unwrap()
    }

    #[test]
    fn added_removed_and_changed_models() {
        let old = catalog(
            "[[model]]\nid = \"a\"\n[[model]]\nid = \"b\"\npinned = true\n[[model]]\nid = \"c\"\n",
        );
        let new = catalog(
            "[pool]\ndefault_model = \"b\"\n[[model]]\nid = \"b\"\npinned = true\ncontext_length = 512\noptions = { kv_bits = \"8\" }\n[[model]]\nid = \"c\"\n[[model]]\nid = \"d\"\npath = \"/m/d\"\n",
        );
        let p = plan(&old, &new);
        assert_eq!(p.added, ["d"]);
        assert_eq!(p.removed, ["a"]);
        assert_eq!(
            p.changed,
            [ModelChange {
                id: "b".into(),
                fields: vec!["limits", "options"]
            }]
        );
        assert_eq!(p.default_model, Some(("a".into(), "b".into())));
        assert!(!p.is_empty());
        assert!(plan(&new, &new).is_empty());
    }

    #[test]
    fn every_model_setting_is_compared() {
        let old = catalog("[[model]]\nid = \"a\"\n");
        let new = catalog(
            "[[model]]\nid = \"a\"\npath = \"/m/a\"\naliases = [\"x\"]\npinned = true\nttl = \"1m\"\nmax_batch_size = 2\nmemory = \"1GiB\"\noptions = { kv_bits = \"4\" }\n",
        );
        assert_eq!(
            changed_fields(&old.models[0], &new.models[0]),
            ["source", "aliases", "pinned", "ttl", "limits", "options", "memory"]
        );
    }

    #[test]
    fn server_settings_that_need_a_restart_keep_their_running_values() {
        let running =
            Config::from_toml_str("[server]\nport = 9000\nqueue_timeout_ms = 1000\n", "a").unwrap();
        let reloaded = Config::from_toml_str(
            "[server]\nport = 9001\nqueue_timeout_ms = 1000\nengine_bin = \"/bin/e\"\n[server.engine_options]\nkv_bits = \"8\"\n[server.limits]\nmax_batch_size = 4\n[pool]\nmax_engines = 1\n[[model]]\nid = \"m\"\n",
            "b",
        )
        .unwrap();
        let (merged, kept) = merge(&running, reloaded);
        assert_eq!(kept, ["port"]);
        assert_eq!(merged.server.port, 9000);
        assert_eq!(merged.server.engine_bin.as_deref(), Some("/bin/e".as_ref()));
        assert_eq!(merged.server.engine_options["kv_bits"], "8");
        assert_eq!(merged.server.limits.max_batch_size, Some(4));
        assert_eq!(merged.pool.max_engines, 1);
        assert_eq!(merged.models[0].id, "m");
        let (_, kept) = merge(&running, running.clone());
        assert!(kept.is_empty());
    }

    #[test]
    fn keys_and_browser_checks_are_reloaded() {
        let running = Config::from_toml_str(
            "[server]
api_keys = [\"old\"]
admin_api_key = \"a1\"
",
            "a",
        )
        .unwrap();
        let reloaded = Config::from_toml_str(
            "[server]
api_keys = [\"new\"]
admin_api_key = \"a2\"
allowed_hosts = [\"h.lan\"]
allowed_origins = [\"http://o\"]
",
            "b",
        )
        .unwrap();
        let (merged, kept) = merge(&running, reloaded);
        assert!(kept.is_empty(), "{kept:?}");
        assert_eq!(merged.api_keys().unwrap(), ["new"]);
        assert_eq!(merged.server.admin_api_key.unwrap().0, "a2");
        assert_eq!(merged.server.allowed_hosts, ["h.lan"]);
        assert_eq!(merged.server.allowed_origins, ["http://o"]);
    }
}
