//! The catalog requests are routed by, and its changes at run time: a configuration reload
//! (`SIGHUP`), and a model that appeared in the store (`mlxd pull`, `mlxd quantize`, a
//! conversion) — served by name at its first request, and listed by `/v1/models`, without a
//! restart. Changes are serialised: each builds a new catalog from the running configuration
//! and the store, lets the pool apply the difference, then routes by it.

use std::sync::{Arc, RwLock};

use mlxd_store::StoreOptions;
use tracing::{info, warn};

use crate::catalog::{self, Catalog};
use crate::config::{Config, ConfigError};
use crate::error::ProxyError;
use crate::pool::PoolHandle;
use crate::reload::ReloadPlan;

type RuntimeAdapters = std::collections::BTreeMap<String, Vec<(String, String)>>;

pub struct Routing {
    /// Replaced after the pool has applied a change.
    catalog: RwLock<Arc<Catalog>>,
    /// Adapters loaded at run time, by model id: name and directory, in load order. Laid
    /// over every catalog routed by ([`Catalog::with_runtime_adapters`]); changed under the
    /// `running` lock, as reloads are.
    runtime_adapters: std::sync::Mutex<RuntimeAdapters>,
    /// The running configuration; held while the catalog changes.
    running: tokio::sync::Mutex<Arc<Config>>,
    pool: PoolHandle,
}

/// The store an engine of `config` resolves models in: `MLXD_HOME` (and the Hugging Face
/// cache variables) from `[server] engine_env` where set there, else from this process's
/// environment, as the engine inherits it. `None` when `pool.store_models` is off or there
/// is no home.
pub fn store_options(config: &Config) -> Option<StoreOptions> {
    if !config.pool.store_models {
        return None;
    }
    let env = &config.server.engine_env;
    let home = match env.get(mlxd_store::ENV_HOME).filter(|h| !h.is_empty()) {
        Some(h) => h.into(),
        None => mlxd_store::default_home().ok()?,
    };
    let mut opts = StoreOptions::from_env(&home);
    if let Some(cache) = env
        .get(mlxd_store::ENV_HF_HUB_CACHE)
        .filter(|c| !c.is_empty())
    {
        opts.hf_cache = Some(cache.into());
    } else if let Some(hf_home) = env.get(mlxd_store::ENV_HF_HOME).filter(|c| !c.is_empty()) {
        opts.hf_cache = Some(std::path::Path::new(hf_home).join("hub"));
    }
    Some(opts)
}

/// The catalog of `config` with the models of its store (blocking: reads directories).
pub fn build_catalog(config: &Config) -> Result<Catalog, ConfigError> {
    let stored = store_options(config)
        .map(|o| mlxd_store::inventory::scan(&o))
        .unwrap_or_default();
    Catalog::from_config_and_store(config, &stored)
}

impl Routing {
    pub fn new(catalog: Arc<Catalog>, config: Arc<Config>, pool: PoolHandle) -> Self {
        Self {
            catalog: RwLock::new(catalog),
            runtime_adapters: Default::default(),
            running: tokio::sync::Mutex::new(config),
            pool,
        }
    }

    /// The catalog requests are routed by now.
    pub fn catalog(&self) -> Arc<Catalog> {
        // A poisoned lock only means a panic mid-swap of an `Arc`; the value is whole.
        self.catalog
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The id of the model a request names ([`Catalog::resolve`]); a name the catalog does
    /// not know is looked up in the store first, and served if found there.
    pub async fn resolve(&self, requested: Option<&str>) -> Result<String, ProxyError> {
        let name = requested.map(str::trim).unwrap_or("");
        if !name.is_empty() && !self.catalog().knows(name) {
            self.refresh(Some(name)).await;
        }
        self.catalog().resolve(requested).map(|m| m.id.clone())
    }

    /// Builds the catalog again from the running configuration and the store, and applies
    /// it when it differs: with `wanted`, only when the new catalog knows that name (an
    /// unknown name never changes what is served).
    pub async fn refresh(&self, wanted: Option<&str>) {
        let running = self.running.lock().await;
        if wanted.is_some_and(|w| self.catalog().knows(w)) {
            return; // found while this waited for the lock
        }
        let config = running.clone();
        let built = tokio::task::spawn_blocking(move || build_catalog(&config)).await;
        let catalog = match built {
            Ok(Ok(c)) => Arc::new(c),
            Ok(Err(e)) => {
                warn!(error = %e, "the model store could not be read again");
                return;
            }
            Err(e) => {
                warn!(error = %e, "reading the model store failed");
                return;
            }
        };
        if wanted.is_some_and(|w| !catalog.knows(w)) {
            return;
        }
        // Only models appearing or going change anything here: a size that moved (weights
        // still being written) waits for the next reload or load.
        let plan = crate::reload::plan(&self.catalog(), &catalog);
        if plan.added.is_empty() && plan.removed.is_empty() {
            return;
        }
        if self.apply(catalog, running.clone()).await.is_some() {
            info!(added = ?plan.added, removed = ?plan.removed, "models in the store changed");
        }
    }

    /// Applies a reloaded configuration: merged with the running one
    /// ([`crate::reload::merge`]), its catalog built (a failure refuses the reload with the
    /// reason, and the running configuration stays), applied by the pool, then routed by.
    pub async fn reload(&self, reloaded: Config) {
        let mut running = self.running.lock().await;
        let (config, kept) = crate::reload::merge(&running, reloaded);
        let built = {
            let config = config.clone();
            tokio::task::spawn_blocking(move || build_catalog(&config)).await
        };
        let catalog = match built {
            Ok(Ok(c)) => Arc::new(c),
            Ok(Err(e)) => {
                warn!(error = %e, "configuration reload refused; the running configuration stays");
                return;
            }
            Err(e) => {
                warn!(error = %e, "configuration reload failed; the running configuration stays");
                return;
            }
        };
        for setting in &kept {
            warn!(
                setting = %format!("server.{setting}"),
                "changed in the configuration file, but it takes effect only when mlxd restarts; the running value stays"
            );
        }
        let config = Arc::new(config);
        let Some(plan) = self.apply(catalog, config.clone()).await else {
            return;
        };
        *running = config;
        let changed: Vec<String> = plan
            .changed
            .iter()
            .map(|c| format!("{} ({})", c.id, c.fields.join(", ")))
            .collect();
        info!(
            added = ?plan.added,
            removed = ?plan.removed,
            changed = ?changed,
            default_model = ?plan.default_model.as_ref().map(|(_, new)| new),
            "configuration reloaded"
        );
    }

    /// `catalog` with the adapters loaded at run time; those of models it lacks, whose source
    /// changed from the catalog routed by now, or whose names its `adapters` options now list
    /// are forgotten, with a log line.
    fn overlaid(&self, catalog: Catalog) -> Catalog {
        let mut overlay = self
            .runtime_adapters
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let (catalog, dropped) = catalog.with_runtime_adapters(&overlay, &self.catalog());
        for (model, name) in &dropped {
            warn!(model = %model, adapter = %name, "an adapter loaded at run time is dropped: its model was removed, has another source, or now lists an adapter of that name");
            if let Some(list) = overlay.get_mut(model) {
                list.retain(|(n, _)| n != name);
            }
        }
        overlay.retain(|_, list| !list.is_empty());
        catalog
    }

    /// Records that `model`'s engine loaded adapter `name` from `dir` (`Some`) or unloaded
    /// it (`None`): requests route to it (or no longer), `/v1/models` lists it, and every
    /// later launch of the model's engines loads it.
    pub async fn set_runtime_adapter(
        &self,
        model: &str,
        name: &str,
        dir: Option<String>,
    ) -> Result<(), ProxyError> {
        let _running = self.running.lock().await;
        let list = {
            let mut overlay = self
                .runtime_adapters
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let list = overlay.entry(model.to_string()).or_default();
            list.retain(|(n, _)| n != name);
            if let Some(dir) = dir {
                list.push((name.to_string(), dir));
            }
            let list = list.clone();
            overlay.retain(|_, l| !l.is_empty());
            list
        };
        let catalog = self.overlaid((*self.catalog()).clone());
        *self.catalog.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(catalog);
        self.pool.set_runtime_adapters(model, list).await
    }

    /// Lets the pool apply `catalog` under `config`, then routes by it. `None` once the pool
    /// has stopped.
    async fn apply(&self, catalog: Arc<Catalog>, config: Arc<Config>) -> Option<ReloadPlan> {
        let catalog = Arc::new(self.overlaid(Arc::unwrap_or_clone(catalog)));
        let budget = catalog::memory_budget(&config);
        let plan = self.pool.reload(catalog.clone(), config, budget).await?;
        *self.catalog.write().unwrap_or_else(|p| p.into_inner()) = catalog;
        Some(plan)
    }
}
