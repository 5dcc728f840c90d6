//! The servable models: `[[model]]` entries, the `models_dir` scan and `--model` flags,
//! then the models of the store that none of them names (`pool.store_models`), resolved into
//! [`ModelEntry`]s; and routing a request's `model` (id or alias) to one of them.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use mlxd_protocol::control::Limits;

use crate::config::{Config, ConfigError, ModelConfig, DEFAULT_MODEL};
use crate::error::ProxyError;

/// One servable model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelEntry {
    pub id: String,
    /// What the engine is asked to load (`Launch.model`).
    pub source: String,
    pub aliases: Vec<String>,
    pub pinned: bool,
    /// Idle unload after this long; zero = never.
    pub ttl: Duration,
    pub limits: Limits,
    /// Engine options: `[server] engine_options` plus the model's own.
    pub options: BTreeMap<String, String>,
    /// Memory to plan for before the engine reports its own: the configured `memory`,
    /// else the weights on disk (0 when unknown: a known name or a repo id).
    pub planned_bytes: u64,
    /// Found in the model store, not configured.
    pub stored: bool,
    /// Keeps a standby engine (see `pool::slot::Standby`).
    pub standby: bool,
    /// The ids of the adapter entries (`[[model]]` with `adapter` and `base`) its engine
    /// serves: each is also one of its `adapters`, and is listed and routed by its own id.
    pub adapter_models: Vec<String>,
    /// LoRA adapters loaded at run time (`POST /admin/models/{id}/adapters`), name and
    /// directory, in load order: routed and listed as its `adapters` are, and passed to
    /// every engine it launches after its `adapters` option (see [`Self::launch_options`]).
    pub runtime_adapters: Vec<(String, String)>,
}

impl ModelEntry {
    /// The names of the LoRA adapters its engine serves (the `adapters` engine option),
    /// each addressed as `<id>:<name>`.
    /// Those loaded at run time follow.
    pub fn adapters(&self) -> Vec<String> {
        let mut names = self.configured_adapters();
        names.extend(self.runtime_adapters.iter().map(|(n, _)| n.clone()));
        names
    }

    /// The adapters its `adapters` option lists.
    fn configured_adapters(&self) -> Vec<String> {
        self.options
            .get("adapters")
            .and_then(|s| mlxd_protocol::engine_options::parse_adapter_list(s).ok())
            .map(|list| list.into_iter().map(|(name, _)| name).collect())
            .unwrap_or_default()
    }

    /// The engine options a launch of this model gets: its `options`, with the adapters
    /// loaded at run time appended to `adapters`, so that a restarted engine (after a
    /// crash, a standby's replacement, an unload and a later load) serves them too.
    pub fn launch_options(&self) -> BTreeMap<String, String> {
        let mut options = self.options.clone();
        if self.runtime_adapters.is_empty() {
            return options;
        }
        let extra = self
            .runtime_adapters
            .iter()
            .map(|(name, dir)| format!("{name}={dir}"));
        let joined = match options.get("adapters").filter(|s| !s.trim().is_empty()) {
            Some(listed) => std::iter::once(listed.clone())
                .chain(extra)
                .collect::<Vec<_>>(),
            None => extra.collect(),
        };
        options.insert("adapters".into(), joined.join(","));
        options
    }

    /// Its adapters as `/v1/models` lists them: an adapter entry by its own id, any other
    /// adapter as `<id>:<name>`.
    pub fn listed_adapters(&self) -> Vec<String> {
        self.adapters()
            .into_iter()
            .map(|a| {
                if self.adapter_models.contains(&a) {
                    a
                } else {
                    format!("{}:{a}", self.id)
                }
            })
            .collect()
    }
}

/// All models and the routing rules.
#[derive(Debug, Clone)]
pub struct Catalog {
    pub models: Vec<ModelEntry>,
    pub default_model: String,
    pub route_unknown_to_default: bool,
    names: BTreeMap<String, usize>,
}

impl Catalog {
    /// Builds the catalog from `config`: the `[[model]]` entries first, then whatever
    /// `models_dir` holds that they do not name already. With no models at all, the
    /// default model (`smollm2-135m`).
    pub fn from_config(config: &Config) -> Result<Self, ConfigError> {
        let mut configs: Vec<ModelConfig> = config.models.clone();
        if let Some(dir) = &config.pool.models_dir {
            for found in scan_models_dir(dir)? {
                let taken = configs
                    .iter()
                    .any(|m| m.id == found.id || m.source() == found.source());
                if !taken {
                    configs.push(found);
                }
            }
        }
        if configs.is_empty() {
            configs.push(ModelConfig::new(DEFAULT_MODEL));
        }
        let checked = Config {
            models: configs.clone(),
            ..config.clone()
        };
        checked.validate(None)?;

        let mut models = Vec::with_capacity(configs.len());
        let mut names = BTreeMap::new();
        for (i, m) in configs.iter().enumerate() {
            if m.is_adapter() {
                continue;
            }
            names.insert(m.id.clone(), models.len());
            for a in &m.aliases {
                names.insert(a.clone(), models.len());
            }
            let options = checked.engine_options_of(i);
            let adapter_models = checked
                .adapter_entries_of(i)
                .map(|a| a.id.clone())
                .collect();
            models.push(ModelEntry {
                id: m.id.clone(),
                source: m.source().to_string(),
                aliases: m.aliases.clone(),
                pinned: m.pinned,
                ttl: m.ttl.unwrap_or(config.pool.ttl),
                limits: m.limits(&config.server.limits),
                options,
                planned_bytes: m.memory.unwrap_or_else(|| weights_on_disk(m.source())),
                stored: false,
                standby: m.standby.unwrap_or(config.pool.standby),
                adapter_models,
                runtime_adapters: Vec::new(),
            });
        }
        // An adapter entry's id routes to its base's engine, which serves the adapter under it.
        for m in configs.iter().filter(|m| m.is_adapter()) {
            let base = m.base.as_deref().unwrap_or_default();
            if let Some(&i) = names.get(base) {
                names.insert(m.id.clone(), i);
            }
        }
        let default_model = match &config.pool.default_model {
            Some(d) => models[names[d.as_str()]].id.clone(),
            None => models[0].id.clone(),
        };
        Ok(Self {
            models,
            default_model,
            route_unknown_to_default: config.pool.route_unknown_to_default,
            names,
        })
    }

    /// [`Self::from_config`], then each model of the store (`stored`, in
    /// [`mlxd_store::inventory::scan`]'s order) whose name is not an id or alias already and
    /// whose source no configured model loads: a configured model wins over a stored one of
    /// the same name. A stored model gets the `[pool]` and `[server]` defaults.
    pub fn from_config_and_store(
        config: &Config,
        stored: &[mlxd_store::inventory::Found],
    ) -> Result<Self, ConfigError> {
        let mut catalog = Self::from_config(config)?;
        for found in stored {
            let source = found.spec();
            let taken = catalog.names.contains_key(&found.name)
                || catalog.models.iter().any(|m| m.source == source);
            if taken {
                continue;
            }
            catalog
                .names
                .insert(found.name.clone(), catalog.models.len());
            catalog.models.push(ModelEntry {
                id: found.name.clone(),
                planned_bytes: weights_on_disk(&found.dir.display().to_string()),
                source,
                aliases: Vec::new(),
                pinned: false,
                ttl: config.pool.ttl,
                limits: Limits::from(&config.server.limits),
                options: config.server.engine_options.clone(),
                stored: true,
                standby: config.pool.standby,
                adapter_models: Vec::new(),
                runtime_adapters: Vec::new(),
            });
        }
        Ok(catalog)
    }

    /// Whether `name` is an id or alias here (no default routing).
    pub fn knows(&self, name: &str) -> bool {
        self.names.contains_key(name)
    }

    /// The model a request names: missing or empty → the default; an id or alias →
    /// that model; `<id or alias>:<adapter>` with one of its `adapters` → that model (its
    /// engine applies the adapter); anything else → 404 listing the ids (or the default, if
    /// so configured). An adapter its model does not list is a 404 either way: the default
    /// model would answer without it.
    pub fn resolve(&self, requested: Option<&str>) -> Result<&ModelEntry, ProxyError> {
        let name = requested.map(str::trim).unwrap_or("");
        if name.is_empty() {
            return Ok(self.default_entry());
        }
        if let Some(&i) = self.names.get(name) {
            return Ok(&self.models[i]);
        }
        if let Some((base, adapter)) = name.rsplit_once(':') {
            if let Some(&i) = self.names.get(base) {
                let entry = &self.models[i];
                let adapters = entry.adapters();
                if adapters.iter().any(|a| a == adapter) {
                    return Ok(entry);
                }
                let mut available = vec![entry.id.clone()];
                available.extend(adapters.iter().map(|a| format!("{base}:{a}")));
                return Err(ProxyError::ModelNotFound {
                    requested: name.to_string(),
                    available,
                });
            }
        }
        if self.route_unknown_to_default {
            return Ok(self.default_entry());
        }
        Err(ProxyError::ModelNotFound {
            requested: name.to_string(),
            available: self.ids(),
        })
    }

    pub fn get(&self, id: &str) -> Option<&ModelEntry> {
        self.names.get(id).map(|&i| &self.models[i])
    }

    /// This catalog with the adapters loaded at run time (by model id, name and directory)
    /// on its models. A model it no longer has loses them, so does a model whose source
    /// differs from its source in `before` (the catalog they were loaded under: adapters
    /// trained for other weights would fail its next load), and so does an adapter its
    /// `adapters` option now lists under the same name (the configured one wins). Returns the
    /// (model, adapter) pairs dropped.
    pub fn with_runtime_adapters(
        mut self,
        overlay: &BTreeMap<String, Vec<(String, String)>>,
        before: &Catalog,
    ) -> (Self, Vec<(String, String)>) {
        let mut dropped = Vec::new();
        for entry in &mut self.models {
            entry.runtime_adapters.clear();
        }
        for (model, adapters) in overlay {
            let Some(&i) = self.names.get(model) else {
                dropped.extend(adapters.iter().map(|(n, _)| (model.clone(), n.clone())));
                continue;
            };
            let entry = &mut self.models[i];
            let moved = before.get(model).is_some_and(|b| b.source != entry.source);
            if entry.id != *model || moved {
                // An alias now (the overlay is keyed by id), or other weights.
                dropped.extend(adapters.iter().map(|(n, _)| (model.clone(), n.clone())));
                continue;
            }
            let configured = entry.configured_adapters();
            let (clash, kept): (Vec<_>, Vec<_>) = adapters
                .iter()
                .cloned()
                .partition(|(n, _)| configured.contains(n));
            dropped.extend(clash.into_iter().map(|(n, _)| (model.clone(), n)));
            entry.runtime_adapters = kept;
        }
        (self, dropped)
    }

    pub fn ids(&self) -> Vec<String> {
        self.models.iter().map(|m| m.id.clone()).collect()
    }

    fn default_entry(&self) -> &ModelEntry {
        self.get(&self.default_model)
            .unwrap_or_else(|| &self.models[0])
    }
}

/// Each subdirectory of `dir` with a `config.json` (id: the directory name) and each
/// `*.gguf` file (id: the file stem), in name order.
pub fn scan_models_dir(dir: &Path) -> Result<Vec<ModelConfig>, ConfigError> {
    let entries = std::fs::read_dir(dir).map_err(|e| ConfigError::Setting {
        field: "pool.models_dir".into(),
        message: format!("cannot read {}: {e}", dir.display()),
    })?;
    let mut paths: Vec<_> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    paths.sort();
    let mut out = Vec::new();
    for p in paths {
        let Some(name) = p.file_name().map(|n| n.to_string_lossy().into_owned()) else {
            continue;
        };
        if name.starts_with('.') {
            continue;
        }
        let id = if p.is_dir() && p.join("config.json").is_file() {
            name
        } else if p.is_file()
            && p.extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
        {
            match p.file_stem() {
                Some(s) => s.to_string_lossy().into_owned(),
                None => continue,
            }
        } else {
            continue;
        };
        out.push(ModelConfig {
            id,
            path: Some(p.display().to_string()),
            ..ModelConfig::default()
        });
    }
    Ok(out)
}

/// Bytes of weights on disk: a `.gguf` file's size, or the sum of a directory's
/// `*.safetensors` and `*.gguf` files; 0 for anything else.
pub fn weights_on_disk(source: &str) -> u64 {
    let p = Path::new(source);
    if p.is_file() {
        return p.metadata().map(|m| m.len()).unwrap_or(0);
    }
    let Ok(entries) = std::fs::read_dir(p) else {
        return 0;
    };
    entries
        .filter_map(Result::ok)
        .filter(|e| {
            let n = e.file_name();
            let n = n.to_string_lossy();
            n.ends_with(".safetensors") || n.ends_with(".gguf")
        })
        .filter_map(|e| e.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum()
}

/// Physical memory in bytes: `MemTotal` from `/proc/meminfo` on Linux, `hw.memsize`
/// on macOS; `None` where neither is available.
pub fn physical_memory() -> Option<u64> {
    #[cfg(target_os = "macos")]
    {
        let mut size: u64 = 0;
        let mut len = std::mem::size_of::<u64>();
        // SAFETY: the name is NUL-terminated; `size` and `len` are valid for writes
        // of the sizes given.
        let rc = unsafe {
            libc::sysctlbyname(
                c"hw.memsize".as_ptr(),
                (&mut size as *mut u64).cast(),
                &mut len,
                std::ptr::null_mut(),
                0,
            )
        };
        if rc == 0 {
            return Some(size);
        }
    }
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_meminfo(&text)
}

fn parse_meminfo(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The memory budget: configured, else physical memory minus the reserve.
pub fn memory_budget(config: &Config) -> u64 {
    config.pool.memory_budget.unwrap_or_else(|| {
        physical_memory()
            .map(|m| m.saturating_sub(config.pool.memory_reserve))
            .unwrap_or(u64::MAX)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn catalog(text: &str) -> Catalog {
        Catalog::from_config(&Config::from_toml_str(text, "t.toml").unwrap()).unwrap()
    }

    #[test]
    fn routing_by_id_alias_and_default() {
        let c = catalog(
            "[pool]\ndefault_model = \"b\"\n[[model]]\nid = \"a\"\naliases = [\"gpt-4\", \"A\"]\n[[model]]\nid = \"b\"\n",
        );
        assert_eq!(c.resolve(Some("a")).unwrap().id, "a");
        assert_eq!(c.resolve(Some("gpt-4")).unwrap().id, "a");
        assert_eq!(c.resolve(Some("A")).unwrap().id, "a");
        assert_eq!(c.resolve(None).unwrap().id, "b");
        assert_eq!(c.resolve(Some("")).unwrap().id, "b");
        match c.resolve(Some("zzz")) {
            Err(ProxyError::ModelNotFound {
                requested,
                available,
            }) => {
                assert_eq!(requested, "zzz");
                assert_eq!(available, ["a", "b"]);
            }
            other => panic!("{other:?}"),
        }
        let c = catalog(
            "[pool]\nroute_unknown_to_default = true\n[[model]]\nid = \"a\"\n[[model]]\nid = \"b\"\n",
        );
        assert_eq!(c.resolve(Some("zzz")).unwrap().id, "a");
    }

    #[test]
    fn an_adapter_routes_to_its_model_and_an_unknown_one_is_a_404() {
        let c = catalog(
            "[pool]\nroute_unknown_to_default = true\n[[model]]\nid = \"a\"\naliases = [\"al\"]\n\
             options = { adapters = \"sql=/d/sql,chat=/d/chat\" }\n[[model]]\nid = \"b\"\n",
        );
        assert_eq!(c.get("a").unwrap().adapters(), ["sql", "chat"]);
        assert_eq!(c.resolve(Some("a:sql")).unwrap().id, "a");
        assert_eq!(c.resolve(Some("al:chat")).unwrap().id, "a");
        // Not the default model without the adapter, though unknown names route there.
        match c.resolve(Some("a:nope")) {
            Err(ProxyError::ModelNotFound {
                requested,
                available,
            }) => {
                assert_eq!(requested, "a:nope");
                assert_eq!(available, ["a", "a:sql", "a:chat"]);
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            c.resolve(Some("b:sql")),
            Err(ProxyError::ModelNotFound { .. })
        ));
    }

    #[test]
    fn an_adapter_entry_routes_to_its_base_and_joins_its_adapters() {
        let c = catalog(
            "[[model]]\nid = \"base\"\naliases = [\"b\"]\n\
             options = { adapters = \"sql=/d/sql\" }\n\
             [[model]]\nid = \"support-bot\"\nbase = \"b\"\nadapter = \"/d/support\"\n\
             [[model]]\nid = \"other\"\n",
        );
        assert_eq!(c.ids(), ["base", "other"], "an adapter entry is no model");
        let base = c.resolve(Some("support-bot")).unwrap();
        assert_eq!(base.id, "base");
        assert_eq!(
            base.options["adapters"], "sql=/d/sql,support-bot=/d/support",
            "the base's engine loads it under the entry's id"
        );
        assert_eq!(base.listed_adapters(), ["base:sql", "support-bot"]);
        assert_eq!(c.resolve(Some("base:support-bot")).unwrap().id, "base");
        assert!(c.get("other").unwrap().adapters().is_empty());
    }

    #[test]
    fn adapters_loaded_at_run_time_route_list_launch_and_yield_to_configured_ones() {
        let c = catalog(
            "[[model]]\nid = \"base\"\naliases = [\"b\"]\n\
             options = { adapters = \"sql=/d/sql\" }\n[[model]]\nid = \"other\"\n",
        );
        let overlay = BTreeMap::from([
            (
                "base".to_string(),
                vec![
                    ("rt".to_string(), "/d/rt".to_string()),
                    ("sql".to_string(), "/d/other-sql".to_string()),
                ],
            ),
            (
                "gone".to_string(),
                vec![("x".to_string(), "/d/x".to_string())],
            ),
        ]);
        let before = c.clone();
        let (c, dropped) = c.with_runtime_adapters(&overlay, &before);
        // A configured name wins; a model no longer there loses its adapters.
        assert_eq!(
            dropped,
            [
                ("base".to_string(), "sql".to_string()),
                ("gone".to_string(), "x".to_string())
            ]
        );
        let base = c.get("base").unwrap();
        assert_eq!(base.adapters(), ["sql", "rt"]);
        assert_eq!(base.listed_adapters(), ["base:sql", "base:rt"]);
        assert_eq!(c.resolve(Some("b:rt")).unwrap().id, "base");
        assert_eq!(
            base.options["adapters"], "sql=/d/sql",
            "the configuration is untouched"
        );
        assert_eq!(base.launch_options()["adapters"], "sql=/d/sql,rt=/d/rt");
        let other = c.get("other").unwrap();
        assert!(!other.launch_options().contains_key("adapters"));
        // Other weights under the same id: adapters loaded for the old ones are dropped.
        let moved = catalog(
            "[[model]]\nid = \"base\"\npath = \"/srv/other-base\"\n[[model]]\nid = \"other\"\n",
        );
        let rt = BTreeMap::from([(
            "base".to_string(),
            vec![("rt".to_string(), "/d/rt".to_string())],
        )]);
        let (m, dropped) = moved.with_runtime_adapters(&rt, &before);
        assert_eq!(dropped, [("base".to_string(), "rt".to_string())]);
        assert!(m.get("base").unwrap().runtime_adapters.is_empty());
        // Unloaded: an empty overlay clears them.
        let (c, _) = c.with_runtime_adapters(&BTreeMap::new(), &before);
        assert_eq!(c.get("base").unwrap().adapters(), ["sql"]);
        assert!(matches!(
            c.resolve(Some("base:rt")),
            Err(ProxyError::ModelNotFound { .. })
        ));
    }

    #[test]
    fn a_wrong_adapter_entry_is_refused_naming_its_field() {
        let refused = |entry: &str| -> String {
            let text = format!("[[model]]\nid = \"m\"\n[[model]]\nid = \"a\"\n{entry}\n");
            match Config::from_toml_str(&text, "t.toml")
                .map_err(|e| e.to_string())
                .and_then(|c| Catalog::from_config(&c).map_err(|e| e.to_string()))
            {
                Ok(_) => panic!("accepted: {entry}"),
                Err(e) => e,
            }
        };
        let e = refused("adapter = \"/d/a\"");
        assert!(e.contains("model[1].base") && e.contains("missing"), "{e}");
        let e = refused("base = \"m\"");
        assert!(e.contains("model[1].adapter"), "{e}");
        let e = refused("base = \"nope\"\nadapter = \"/d/a\"");
        assert!(e.contains("model[1].base") && e.contains("\"nope\""), "{e}");
        let e = refused("base = \"m\"\nadapter = \"/d/a\"\npinned = true");
        assert!(
            e.contains("model[1].pinned") && e.contains("belongs on its base"),
            "{e}"
        );
        let e = refused("base = \"m\"\nadapter = \"/d/a,b\"");
        assert!(e.contains("model[1].adapter"), "{e}");
        // An adapter entry's base cannot be another adapter entry.
        let text =
            "[[model]]\nid = \"m\"\n[[model]]\nid = \"a\"\nbase = \"m\"\nadapter = \"/d/a\"\n\
                    [[model]]\nid = \"c\"\nbase = \"a\"\nadapter = \"/d/c\"\n";
        let e = Config::from_toml_str(text, "t.toml")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("model[2].base") && e.contains("itself an adapter"),
            "{e}"
        );
        // Nor the default model.
        let text = "[pool]\ndefault_model = \"a\"\n[[model]]\nid = \"m\"\n\
                    [[model]]\nid = \"a\"\nbase = \"m\"\nadapter = \"/d/a\"\n";
        let e = Config::from_toml_str(text, "t.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("default_model"), "{e}");
        // The same name in the base's own adapters is listed twice.
        let text = "[[model]]\nid = \"m\"\noptions = { adapters = \"a=/d/x\" }\n\
                    [[model]]\nid = \"a\"\nbase = \"m\"\nadapter = \"/d/a\"\n";
        let e = Catalog::from_config(&Config::from_toml_str(text, "t.toml").unwrap())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("model[0].options.adapters") && e.contains("twice"),
            "{e}"
        );
    }

    #[test]
    fn default_alias_resolves_to_its_model() {
        let c =
            catalog("[pool]\ndefault_model = \"x\"\n[[model]]\nid = \"a\"\naliases = [\"x\"]\n");
        assert_eq!(c.default_model, "a");
    }

    #[test]
    fn nothing_configured_serves_the_default_model() {
        let c = Catalog::from_config(&Config::default()).unwrap();
        assert_eq!(c.ids(), [DEFAULT_MODEL]);
        assert_eq!(c.resolve(None).unwrap().source, DEFAULT_MODEL);
    }

    #[test]
    fn models_dir_scan_and_sizes() {
        let dir = tempfile::tempdir().unwrap();
        let llama = dir.path().join("tiny-llama");
        std::fs::create_dir(&llama).unwrap();
        std::fs::write(llama.join("config.json"), "{}").unwrap();
        std::fs::write(llama.join("model-00001.safetensors"), vec![0u8; 1000]).unwrap();
        std::fs::write(llama.join("model-00002.safetensors"), vec![0u8; 500]).unwrap();
        std::fs::write(llama.join("tokenizer.json"), vec![0u8; 9999]).unwrap();
        std::fs::create_dir(dir.path().join("not-a-model")).unwrap();
        std::fs::create_dir(dir.path().join(".hidden")).unwrap();
        std::fs::write(dir.path().join(".hidden/config.json"), "{}").unwrap();
        std::fs::write(dir.path().join("smol.gguf"), vec![0u8; 300]).unwrap();
        std::fs::write(dir.path().join("notes.txt"), "x").unwrap();
        // A configured entry wins over the scanned one of the same id.
        let text = format!(
            "[pool]\nmodels_dir = {:?}\n[[model]]\nid = \"smol\"\npath = \"smollm2-135m\"\npinned = true\n",
            dir.path().display().to_string()
        );
        let c = catalog(&text);
        assert_eq!(c.ids(), ["smol", "tiny-llama"]);
        assert!(c.get("smol").unwrap().pinned);
        assert_eq!(c.get("smol").unwrap().source, "smollm2-135m");
        let t = c.get("tiny-llama").unwrap();
        assert_eq!(t.source, llama.display().to_string());
        assert_eq!(t.planned_bytes, 1500);
        let scanned = scan_models_dir(dir.path()).unwrap();
        assert_eq!(scanned.len(), 2);
        assert_eq!(
            weights_on_disk(&dir.path().join("smol.gguf").display().to_string()),
            300
        );
        assert!(scan_models_dir(&dir.path().join("missing")).is_err());
    }

    #[test]
    fn store_models_after_the_configured_ones() {
        let dir = tempfile::tempdir().unwrap();
        let found = |name: &str, kind| mlxd_store::inventory::Found {
            name: name.into(),
            kind,
            dir: dir.path().join(name),
        };
        use mlxd_store::inventory::StoredKind;
        let stored = [
            found(DEFAULT_MODEL, StoredKind::Known),
            found("smol-q8", StoredKind::Local),
            // Named like a configured alias: the configured model wins.
            found("fast", StoredKind::Local),
            found("org/m", StoredKind::HuggingFace),
        ];
        let config = Config::from_toml_str(
            "[pool]\nttl = \"1m\"\n[server.engine_options]\nkv_bits = \"8\"\n[[model]]\nid = \"small\"\npath = \"smollm2-135m\"\naliases = [\"fast\"]\n",
            "t.toml",
        )
        .unwrap();
        let c = Catalog::from_config_and_store(&config, &stored).unwrap();
        // smollm2-135m is what `small` loads already.
        assert_eq!(c.ids(), ["small", "smol-q8", "org/m"]);
        let q8 = c.resolve(Some("smol-q8")).unwrap();
        assert!(q8.stored && !c.get("small").unwrap().stored);
        assert_eq!(q8.source, dir.path().join("smol-q8").display().to_string());
        assert_eq!(
            (q8.ttl, q8.options["kv_bits"].as_str()),
            (Duration::from_secs(60), "8")
        );
        assert_eq!(c.get("org/m").unwrap().source, "org/m");
        assert_eq!(c.resolve(Some("fast")).unwrap().id, "small");
        assert_eq!(c.default_model, "small");
        assert!(c.knows("smol-q8") && !c.knows("zzz"));
        // Nothing configured: the default model first, then the store's.
        let c = Catalog::from_config_and_store(&Config::default(), &stored[1..2]).unwrap();
        assert_eq!(c.ids(), [DEFAULT_MODEL, "smol-q8"]);
    }

    #[test]
    fn meminfo() {
        let text = "MemTotal:       16384000 kB\nMemFree:  1 kB\n";
        assert_eq!(parse_meminfo(text), Some(16_384_000 * 1024));
        assert!(physical_memory().unwrap_or(1) > 0);
    }
}
