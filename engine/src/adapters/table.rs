//! The adapters one loaded model holds, the linear layers they apply to, and each forward
//! pass's choice of adapter per row.
//!
//! Every [`Linear`](crate::models::layers::Linear) a model loads outside a tensor-parallel
//! group registers a [`LoraSite`] here under its checkpoint name (`model.layers.3.mlp.up_proj`),
//! through the load scope [`loading_into`] opens; an adapter's tensors (`<name>.lora_a`,
//! `<name>.lora_b`) are matched to the sites by that name. Before a forward pass the runtime
//! [`selects`](AdapterTable::select) each row's adapter; the selection lives until the guard
//! it returns is dropped, and every site reads it while the pass's graph is built:
//!
//! - no row has an adapter: the sites see a cleared flag and do nothing (no lock, no op);
//! - every row has the same adapter: `y + (scale * (x @ A) @ B)` as mlx-lm's `LoRALinear`,
//!   the scale carried by `B` since the load (`scale · B`, so that a pass spends no op on
//!   it), and the add folded into the second matmul (`addmm`) where `x` and the factors share
//!   a dtype; a DoRA adapter's output is then multiplied by its per-output-row rescale
//!   ([`super::dora`]), computed from the base weight on the adapter's first pass and kept;
//! - rows differ: each site keeps the factors of every loaded adapter side by side, `A`
//!   `[in, R]` and `B` `[R, out]` (`R` the sum of their ranks; zeros for an adapter that
//!   leaves the site alone; built by the first such pass after a load or unload, in its own
//!   graph, and kept), and the pass one mask `[B, 1, R]` that keeps each row's own adapter's
//!   columns (none for a base row, nor for a loaded adapter no row takes):
//!   `((x @ A) * mask) @ B` is every row's own update, in two plain matmuls and a multiply,
//!   however many adapters the rows take (a gather of per-row factors costs a GPU more:
//!   launches, and a copy of the factors per row and site). The factors hold every loaded
//!   adapter, not only those the rows take, because the set the rows take changes as served
//!   rows join and leave, and rebuilding every group's factors for each new set put their
//!   concatenations into that pass's graph again (35 ops a layer of a tiny Llama with four
//!   adapters, `bench_adapter_pass`, BENCHMARKS.md); a pass instead reads the factors of
//!   loaded adapters it does not use (rank-sized, a few percent of a step's weights for a
//!   handful of adapters). When
//!   a DoRA adapter changes the site, its rescales are stacked too (ones for the other
//!   entries) and gathered per row, so a DoRA row costs one multiply more than a LoRA row.
//!
//! An expert stack (`SwitchLinear`, `[E, out, in]`) is a site too, registered with its number
//! of experts: its factors are one pair per expert (`lora_a` `[E, r, in]`, `lora_b`
//! `[E, out, r]`, mlx-lm's `LoRASwitchLinear`), and each `(token, expert)` pair takes the
//! pair of the expert it was routed to ([`super::experts`]). mlx-lm has no DoRA for expert
//! stacks, so a DoRA adapter that changes one is refused.
use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use mlx_rs::error::Exception;
use mlx_rs::ops::{concatenate, stack, zeros_dtype};
use mlx_rs::{Array, Dtype};

use super::config::{self, AdapterKind};
use super::experts::{self, PairAdapters};
use super::group::{self, GroupFactors, GroupUpdate};
use super::widened::{self, Epilogue, Widened, WidenedPass};
use super::{dora, AdapterError, AdapterId};
use crate::models::layers::{Matrix, MatrixCell};

/// One loaded adapter, as listed.
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterSummary {
    pub id: AdapterId,
    pub name: String,
    pub dir: PathBuf,
    /// LoRA or DoRA.
    pub kind: super::config::AdapterKind,
    pub rank: usize,
    pub scale: f32,
    /// Linear layers it changes.
    pub layers: usize,
}

/// The adapters beside one base model (see the module comment).
pub struct AdapterTable {
    state: Mutex<State>,
    /// Whether the current selection has a row with an adapter: every site reads it before
    /// taking the lock, so that a base-only pass costs one atomic load per linear.
    engaged: AtomicBool,
}

#[derive(Default)]
struct State {
    sites: Vec<Site>,
    /// Loaded adapters; a site's `factors` follow this order.
    adapters: Vec<Loaded>,
    next_id: u64,
    selection: Selection,
    /// Per group of sites computed as one stacked product (their indices), its factors
    /// ([`super::group`]); emptied when adapters are loaded or unloaded.
    groups: HashMap<Vec<usize>, GroupCache>,
    /// The last pass's selection of rows of different adapters and its rows' slots: the next
    /// pass whose rows take the same adapters in the same order (every decode step until a
    /// row joins or leaves) reuses its arrays rather than making two from host data (on
    /// CUDA, allocations of unified memory). Emptied when adapters are loaded or unloaded.
    last_mixed: Option<(Vec<i32>, Mixed)>,
    /// Per loaded adapter (index into `adapters`), the mask `[1, 1, R]` of its columns, for a
    /// pass whose rows all take it through a widened product ([`widened`]). Emptied when
    /// adapters are loaded or unloaded.
    one_masks: HashMap<usize, Array>,
}

/// A group's factors, built by its first pass that needs them.
#[derive(Default)]
struct GroupCache {
    /// Per adapter (index into `State::adapters`) that every row of a pass takes.
    one: HashMap<usize, GroupFactors>,
    /// For a pass that mixes rows: the factors of every loaded adapter.
    mixed: Option<GroupFactors>,
    /// The group's matrix (one linear layer's, or a stacked product's) widened by every
    /// loaded adapter's `A` ([`widened`]).
    widened: Option<Widened>,
}

struct Loaded {
    summary: AdapterSummary,
    /// Its factors' dtype (float32 when they differ).
    dtype: Dtype,
}

#[derive(Clone)]
struct Factors {
    /// `[in, r]`.
    a: Array,
    /// `[r, out]`. A loaded adapter's carries its scale (`scale · lora_b`, multiplied in
    /// `lora_b`'s dtype at load), so that serving spends no op on it; a training selection's
    /// is the bare `lora_b`, its scale applied by each pass.
    b: Array,
    /// DoRA's magnitude `[out]` (`None`: a LoRA adapter).
    m: Option<Array>,
    /// DoRA's rescale `m / ‖W + scale·Bᵀ·Aᵀ‖` `[out]` of a served adapter: a function of the
    /// adapter and the base weight only, computed by the adapter's first pass here and kept.
    rescale: Option<Array>,
}

impl Factors {
    /// A served DoRA adapter's rescale here, computed on first use from the site's weight
    /// (`b` already carries the scale: mlx-lm's `scale · Bᵀ` is the same product).
    fn served_rescale(&mut self, matrix: &Matrix) -> Result<Option<&Array>, Exception> {
        let Some(m) = &self.m else {
            return Ok(None);
        };
        if self.rescale.is_none() {
            let r = dora::rescale(m, &dora::dense_weight(matrix)?, &self.a, &self.b, 1.0)?;
            r.eval()?;
            self.rescale = Some(r);
        }
        Ok(self.rescale.as_ref())
    }
}

/// A site's factors over every loaded adapter, for passes that mix rows.
struct Stacked {
    /// A linear layer: the adapters' `A` side by side `[in, R]` (`R`: the sum of their
    /// ranks, [`Mixed::mask`]'s columns; zeros for one that leaves the layer alone). An
    /// expert stack: `[(n + 1)·E, r_max, in]` ([`experts::stacked`]).
    a: Array,
    /// A linear layer: their scaled `B` stacked `[R, out]`. An expert stack:
    /// `[(n + 1)·E, out, r_max]`.
    b: Array,
    /// When a DoRA adapter changes the site: the rescales `[n + 1, 1, out]` (ones for the
    /// other entries) and which entries are DoRA's `[n + 1, 1, 1]`.
    dora: Option<(Array, Array)>,
}

struct Site {
    prefix: String,
    in_dims: i32,
    out_dims: i32,
    /// An expert stack's number of experts (`None`: a linear layer).
    experts: Option<i32>,
    /// Dropped with the linear that registered it: a layer a family loaded through `Linear`
    /// and then took apart (an expert stack) is no site.
    alive: Weak<SiteRef>,
    /// Per loaded adapter, its factors here (`None`: it leaves this layer alone).
    factors: Vec<Option<Factors>>,
    /// The factors of the adapters of a pass that mixes rows, side by side; built by the
    /// first such pass after the adapters, or the set a pass's rows take, change.
    stacked: Option<Stacked>,
}

#[derive(Default)]
enum Selection {
    #[default]
    Base,
    /// Every row takes the adapter at this index of `State::adapters`.
    One(usize),
    /// Rows differ (see [`Mixed`]).
    Mixed(Mixed),
    /// A training step ([`AdapterTable::select_training`]): every row takes these factors
    /// (by site index; `None` leaves the site alone), the arrays the gradient is taken of;
    /// a DoRA site's rescale is recomputed from them by each pass.
    Training {
        factors: Vec<Option<Factors>>,
        scale: f32,
        dropout: Option<TrainingDropout>,
    },
}

/// A pass whose rows take different adapters.
#[derive(Clone)]
struct Mixed {
    /// Per row `[B]`: 0 (no adapter) or `i + 1` (`adapters[i]`).
    slots: Array,
    /// The adapters the rows take (indices into `State::adapters`, ascending): a site that
    /// none of them changes adds nothing.
    used: Vec<usize>,
    /// Per row, which of the columns of the sites' side-by-side factors (`Stacked::a`, each
    /// loaded adapter's `rank` columns in load order) are its adapter's: `[B, 1, R]`, one
    /// there and zero elsewhere (a base row: all zero), in the loaded adapters' dtype
    /// ([`common_dtype`]). Built once per pass; each site multiplies `x @ A` by it, so that a
    /// row's update is its own adapter's alone.
    mask: Array,
    rows: i32,
}

/// Dropout on a training step's LoRA input, as mlx-lm's `LoRALinear` applies it
/// (`nn.Dropout(p)` on `x` before `lora_a`): each site draws its mask from `key` folded with
/// the site's index, so a step's masks are a function of the key alone (a resumed run draws
/// the same ones). The key is an array, not a seed, so that a compiled training step takes
/// it as an input instead of baking one step's masks into its graph.
#[derive(Debug, Clone)]
pub struct TrainingDropout {
    pub p: f32,
    /// The step's PRNG key (`mlx_rs::random::key`).
    pub key: Array,
}

/// A training step's arrays at one site: LoRA's factors, and DoRA's magnitude when training
/// a DoRA adapter.
#[derive(Debug, Clone)]
pub struct TrainingFactors {
    pub a: Array,
    pub b: Array,
    pub m: Option<Array>,
}

/// A training selection's arrays at the linear layers of one transformer layer, which a
/// checkpointed layer takes as its inputs ([`super::checkpoint`]).
#[derive(Clone)]
pub struct LayerTraining {
    /// Site index, and whether it has DoRA's `m` (`lora_a`, `lora_b`, `m` in `arrays`).
    sites: Vec<(usize, bool)>,
    arrays: Vec<Array>,
    scale: f32,
    dropout: Option<TrainingDropout>,
}

impl LayerTraining {
    /// The arrays, site by site: `lora_a`, `lora_b` (and `m`).
    pub fn arrays(&self) -> impl Iterator<Item = &Array> {
        self.arrays.iter()
    }

    /// The same sites with `arrays` (as many, in the same order) in place of these.
    pub fn with_arrays(&self, arrays: &[Array]) -> Self {
        Self {
            arrays: arrays.to_vec(),
            ..self.clone()
        }
    }
}

/// The transformer layer of a site's name (`model.layers.12.mlp.up_proj` → 12).
pub fn layer_of(prefix: &str) -> Option<usize> {
    let mut parts = prefix.split('.');
    while let Some(p) = parts.next() {
        if p == "layers" {
            return parts.next()?.parse().ok();
        }
    }
    None
}

/// A linear layer adapters can change, as training addresses it.
#[derive(Debug, Clone, PartialEq)]
pub struct SiteInfo {
    /// The index [`AdapterTable::select_training`]'s factors follow.
    pub index: usize,
    /// The layer's checkpoint name (`model.layers.3.mlp.up_proj`), the prefix of its
    /// `.lora_a` and `.lora_b` in an adapter file.
    pub prefix: String,
    pub in_dims: i32,
    pub out_dims: i32,
    /// An expert stack's number of experts: its factors are `[E, r, in]` and `[E, out, r]`
    /// (`None`: a linear layer, `[in, r]` and `[r, out]`).
    pub experts: Option<i32>,
}

impl fmt::Debug for AdapterTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.lock();
        f.debug_struct("AdapterTable")
            .field("sites", &state.sites.len())
            .field("adapters", &state.adapters.len())
            .finish()
    }
}

impl Default for AdapterTable {
    fn default() -> Self {
        Self::new()
    }
}

impl AdapterTable {
    pub fn new() -> Self {
        Self {
            state: Mutex::new(State::default()),
            engaged: AtomicBool::new(false),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state is consistent between statements; a panic elsewhere cannot tear it.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Linear layers adapters can change.
    pub fn site_count(&self) -> usize {
        self.lock()
            .sites
            .iter()
            .filter(|s| s.alive.strong_count() > 0)
            .count()
    }

    /// The linear layers adapters can change, in registration order.
    pub fn sites(&self) -> Vec<SiteInfo> {
        self.lock()
            .sites
            .iter()
            .enumerate()
            .filter(|(_, s)| s.alive.strong_count() > 0)
            .map(|(index, s)| SiteInfo {
                index,
                prefix: s.prefix.clone(),
                in_dims: s.in_dims,
                out_dims: s.out_dims,
                experts: s.experts,
            })
            .collect()
    }

    /// Makes `factors` (per site index, [`Self::sites`]) the adapter of every row of the
    /// forward passes built until the guard is dropped: a training step's pass, whose
    /// gradient is taken with respect to these arrays.
    pub fn select_training(
        &self,
        factors: Vec<Option<TrainingFactors>>,
        scale: f32,
        dropout: Option<TrainingDropout>,
    ) -> Selected<'_> {
        let mut state = self.lock();
        state.selection = Selection::Training {
            factors: factors
                .into_iter()
                .map(|f| {
                    f.map(|f| Factors {
                        a: f.a,
                        b: f.b,
                        m: f.m,
                        rescale: None,
                    })
                })
                .collect(),
            scale,
            dropout,
        };
        self.engaged.store(true, Ordering::Release);
        Selected { table: Some(self) }
    }

    /// The current training selection's arrays at the sites of transformer layer `layer`
    /// (none when no training step is selected).
    pub fn training_of_layer(&self, layer: usize) -> LayerTraining {
        let state = self.lock();
        let mut out = LayerTraining {
            sites: Vec::new(),
            arrays: Vec::new(),
            scale: 0.0,
            dropout: None,
        };
        if let Selection::Training {
            factors,
            scale,
            dropout,
        } = &state.selection
        {
            out.scale = *scale;
            out.dropout = dropout.clone();
            for (index, f) in factors.iter().enumerate() {
                let Some(f) = f else { continue };
                if state.sites.get(index).and_then(|s| layer_of(&s.prefix)) != Some(layer) {
                    continue;
                }
                out.sites.push((index, f.m.is_some()));
                out.arrays.extend([f.a.clone(), f.b.clone()]);
                out.arrays.extend(f.m.clone());
            }
        }
        out
    }

    /// Runs `f` with `layer`'s arrays as the training selection, then restores the selection
    /// there was: a checkpointed layer's call, in the forward pass (inside the step's own
    /// selection) or again in the backward pass (after it).
    pub fn with_training<R>(&self, layer: LayerTraining, f: impl FnOnce() -> R) -> R {
        let n = self.lock().sites.len();
        let mut factors: Vec<Option<Factors>> = vec![None; n];
        let mut arrays = layer.arrays.into_iter();
        for (index, dora) in layer.sites {
            let (Some(a), Some(b)) = (arrays.next(), arrays.next()) else {
                break;
            };
            let m = if dora { arrays.next() } else { None };
            factors[index] = Some(Factors {
                a,
                b,
                m,
                rescale: None,
            });
        }
        let selection = Selection::Training {
            factors,
            scale: layer.scale,
            dropout: layer.dropout,
        };
        /// Puts the earlier selection back, also when `f` unwinds.
        struct Restore<'t> {
            table: &'t AdapterTable,
            previous: Option<Selection>,
            engaged: bool,
        }
        impl Drop for Restore<'_> {
            fn drop(&mut self) {
                if let Some(previous) = self.previous.take() {
                    self.table.lock().selection = previous;
                }
                self.table.engaged.store(self.engaged, Ordering::Release);
            }
        }
        let previous = std::mem::replace(&mut self.lock().selection, selection);
        let _restore = Restore {
            table: self,
            previous: Some(previous),
            engaged: self.engaged.swap(true, Ordering::AcqRel),
        };
        f()
    }

    /// Loads the mlx-lm adapter in `dir` under `name`. Every tensor must be a `lora_a` or
    /// `lora_b` (and, of a DoRA adapter, an `m`) of a linear layer of this model with the
    /// shapes the config's rank implies.
    pub fn load(&self, name: &str, dir: &Path) -> Result<AdapterId, AdapterError> {
        check_name(name)?;
        let config_path = dir.join("adapter_config.json");
        let text = std::fs::read_to_string(&config_path).map_err(|e| AdapterError::Read {
            path: config_path.clone(),
            message: e.to_string(),
        })?;
        let config = config::parse(&text)?;
        let weights_path = dir.join("adapters.safetensors");
        let tensors = Array::load_safetensors(&weights_path).map_err(|e| AdapterError::Read {
            path: weights_path.clone(),
            message: e.to_string(),
        })?;
        if tensors.is_empty() {
            return Err(AdapterError::Invalid(format!(
                "{} holds no tensors",
                weights_path.display()
            )));
        }
        let dora = config.kind == AdapterKind::Dora;
        let mut parts: HashMap<String, [Option<Array>; 3]> = HashMap::new();
        for (key, array) in tensors {
            let (prefix, part) = if let Some(p) = key.strip_suffix(".lora_a") {
                (p, 0)
            } else if let Some(p) = key.strip_suffix(".lora_b") {
                (p, 1)
            } else if let Some(p) = key.strip_suffix(".m").filter(|_| dora) {
                (p, 2)
            } else {
                let what = if dora {
                    "a DoRA tensor (a `.lora_a`, `.lora_b` or `.m`)"
                } else {
                    "a LoRA tensor (a `.lora_a` or `.lora_b`)"
                };
                return Err(AdapterError::Invalid(format!("{key}: not {what}")));
            };
            if !matches!(
                array.dtype(),
                Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16
            ) {
                return Err(AdapterError::Invalid(format!(
                    "{key}: dtype {:?}, expected a float",
                    array.dtype()
                )));
            }
            parts.entry(prefix.to_owned()).or_default()[part] = Some(array);
        }
        let rank = config.rank as i32;
        let mut state = self.lock();
        if state.adapters.iter().any(|a| a.summary.name == name) {
            return Err(AdapterError::Duplicate(name.to_owned()));
        }
        let mut factors: Vec<Option<Factors>> = vec![None; state.sites.len()];
        let mut names: Vec<&String> = parts.keys().collect();
        names.sort();
        // Before any other check of its layers: the reason is the adapter's kind.
        let stack = names.iter().find(|p| {
            state
                .sites
                .iter()
                .any(|s| s.prefix == ***p && s.experts.is_some())
        });
        if let (true, Some(prefix)) = (dora, stack) {
            return Err(AdapterError::Refused(format!(
                "{prefix}: a DoRA adapter that changes an expert stack; DoRA has no form for \
                 expert stacks (mlx-lm refuses it too: \"SwitchLinear doesn't support DoRA\"), \
                 train a LoRA adapter for this model"
            )));
        }
        for prefix in names {
            let [a, b, m] = &parts[prefix];
            let (Some(a), Some(b)) = (a, b) else {
                return Err(AdapterError::Invalid(format!(
                    "{prefix}: has only one of `lora_a` and `lora_b`"
                )));
            };
            if dora && m.is_none() {
                return Err(AdapterError::Invalid(format!(
                    "{prefix}: a DoRA adapter's layer has no `m` (its magnitude)"
                )));
            }
            let Some(index) = state
                .sites
                .iter()
                .position(|s| s.prefix == *prefix && s.alive.strong_count() > 0)
            else {
                return Err(AdapterError::Invalid(format!(
                    "{prefix}: no linear layer of this model has that name (adapters apply to \
                     the linear layers and expert stacks of a model loaded whole: attention, \
                     MLP and expert projections, routers)"
                )));
            };
            let site = &state.sites[index];
            let expect = |what: &str, a: &Array, shape: &[i32]| {
                if a.shape() == shape {
                    Ok(())
                } else {
                    Err(AdapterError::Invalid(format!(
                        "{prefix}.{what}: shape {:?}, expected {shape:?} (rank {rank} from \
                         adapter_config.json, the layer is {} → {}{})",
                        a.shape(),
                        site.in_dims,
                        site.out_dims,
                        match site.experts {
                            Some(e) => format!(", {e} experts"),
                            None => String::new(),
                        }
                    )))
                }
            };
            let (n_in, n_out) = (site.in_dims, site.out_dims);
            match site.experts {
                Some(e) => {
                    expect("lora_a", a, &[e, rank, n_in])?;
                    expect("lora_b", b, &[e, n_out, rank])?;
                }
                None => {
                    expect("lora_a", a, &[n_in, rank])?;
                    expect("lora_b", b, &[rank, n_out])?;
                }
            }
            if let Some(m) = m {
                if m.shape() != [site.out_dims] {
                    return Err(AdapterError::Invalid(format!(
                        "{prefix}.m: shape {:?}, expected [{}] (the layer's outputs)",
                        m.shape(),
                        site.out_dims
                    )));
                }
            }
            // The scale is a Python float in mlx-lm (it takes the dtype of what it
            // multiplies); carried by `b`, it costs a pass no op.
            let scale = Array::from_f32(config.scale).as_dtype(b.dtype())?;
            factors[index] = Some(Factors {
                a: a.clone(),
                b: b.multiply(&scale)?,
                m: m.clone(),
                rescale: None,
            });
        }
        let dtypes: Vec<Dtype> = factors
            .iter()
            .flatten()
            .flat_map(|f| [f.a.dtype(), f.b.dtype()])
            .collect();
        let dtype = common_dtype(&dtypes);
        let arrays: Vec<&Array> = factors
            .iter()
            .flatten()
            .flat_map(|f| [&f.a, &f.b].into_iter().chain(&f.m))
            .collect();
        mlx_rs::transforms::eval(arrays)?;
        let id = AdapterId(state.next_id);
        state.next_id += 1;
        let layers = factors.iter().flatten().count();
        for (site, f) in state.sites.iter_mut().zip(factors) {
            site.factors.push(f);
            site.stacked = None;
        }
        state.groups.clear();
        state.last_mixed = None;
        state.one_masks.clear();
        state.adapters.push(Loaded {
            summary: AdapterSummary {
                id,
                name: name.to_owned(),
                dir: dir.to_owned(),
                kind: config.kind,
                rank: config.rank,
                scale: config.scale,
                layers,
            },
            dtype,
        });
        Ok(id)
    }

    /// The loaded adapter called `name`.
    pub fn id_of(&self, name: &str) -> Option<AdapterId> {
        self.lock()
            .adapters
            .iter()
            .find(|a| a.summary.name == name)
            .map(|a| a.summary.id)
    }

    /// Unloads the adapter `id`, dropping its factors everywhere (their memory is freed once
    /// no pass holds them); its id is never given again. Call it between forward passes,
    /// when no row runs with it: a later selection naming it fails. `None`: not loaded.
    pub fn unload(&self, id: AdapterId) -> Option<AdapterSummary> {
        let mut state = self.lock();
        let index = state.adapters.iter().position(|a| a.summary.id == id)?;
        let loaded = state.adapters.remove(index);
        for site in &mut state.sites {
            site.factors.remove(index);
            site.stacked = None;
        }
        state.groups.clear();
        state.last_mixed = None;
        state.one_masks.clear();
        Some(loaded.summary)
    }

    /// Every loaded adapter, in load order.
    pub fn list(&self) -> Vec<AdapterSummary> {
        self.lock()
            .adapters
            .iter()
            .map(|a| a.summary.clone())
            .collect()
    }

    /// Makes `rows` (one entry per batch row, in order: its adapter or none) the selection of
    /// the forward passes built until the returned guard is dropped.
    pub fn select(&self, rows: &[Option<AdapterId>]) -> Result<Selected<'_>, Exception> {
        if rows.iter().all(Option::is_none) {
            return Ok(Selected { table: None });
        }
        let mut state = self.lock();
        let slot = |id: AdapterId| {
            state
                .adapters
                .iter()
                .position(|a| a.summary.id == id)
                .ok_or_else(|| Exception::custom(format!("adapter {id:?} is not loaded")))
        };
        let first = rows[0];
        let selection = if rows.iter().all(|r| *r == first) {
            Selection::One(slot(first.expect("some row has an adapter"))?)
        } else {
            let mut slots = Vec::with_capacity(rows.len());
            let mut used = Vec::new();
            for row in rows {
                match row {
                    None => slots.push(0i32),
                    Some(id) => {
                        let i = slot(*id)?;
                        slots.push(i as i32 + 1);
                        used.push(i);
                    }
                }
            }
            used.sort_unstable();
            used.dedup();
            match &state.last_mixed {
                Some((last, mixed)) if *last == slots => Selection::Mixed(mixed.clone()),
                _ => {
                    let mixed = mixed_selection(&state.adapters, &slots, used)?;
                    state.last_mixed = Some((slots, mixed.clone()));
                    Selection::Mixed(mixed)
                }
            }
        };
        state.selection = selection;
        self.engaged.store(true, Ordering::Release);
        Ok(Selected { table: Some(self) })
    }

    /// This pass's update of the sites `sites` (indices; linear layers computed as one
    /// stacked product, in its order), as one product pair ([`super::group`]).
    pub(crate) fn group_update(&self, sites: &[usize]) -> Result<GroupUpdate, Exception> {
        if !self.engaged.load(Ordering::Acquire) {
            return Ok(GroupUpdate::None);
        }
        let mut guard = self.lock();
        let State {
            sites: all,
            adapters,
            selection,
            groups,
            ..
        } = &mut *guard;
        let group: Vec<&Site> = sites.iter().map(|&i| &all[i]).collect();
        if group.iter().any(|s| s.experts.is_some()) {
            return Err(Exception::custom(
                "an expert stack was stacked with linear layers as one product",
            ));
        }
        match selection {
            Selection::Base => Ok(GroupUpdate::None),
            Selection::Training { .. } => Ok(GroupUpdate::PerLayer),
            Selection::One(i) => {
                let i = *i;
                let factors: Vec<Option<&Factors>> =
                    group.iter().map(|s| s.factors[i].as_ref()).collect();
                if factors.iter().all(Option::is_none) {
                    return Ok(GroupUpdate::None);
                }
                if factors.iter().flatten().any(|f| f.m.is_some()) {
                    return Ok(GroupUpdate::PerLayer);
                }
                let cache = group_cache(groups, sites);
                if let Some(f) = cache.one.get(&i) {
                    return Ok(GroupUpdate::Update(f.clone()));
                }
                let f = group_factors(&group, &[(i, adapters[i].summary.rank, adapters[i].dtype)])?;
                cache.one.insert(i, f.clone());
                Ok(GroupUpdate::Update(f))
            }
            Selection::Mixed(Mixed { used, mask, .. }) => {
                let touched = |s: &&Site| used.iter().any(|&i| s.factors[i].is_some());
                if !group.iter().any(touched) {
                    return Ok(GroupUpdate::None);
                }
                let dora = |s: &&Site| {
                    used.iter()
                        .any(|&i| matches!(&s.factors[i], Some(f) if f.m.is_some()))
                };
                if group.iter().any(dora) {
                    return Ok(GroupUpdate::PerLayer);
                }
                let cache = group_cache(groups, sites);
                let f = match &cache.mixed {
                    Some(f) => f.clone(),
                    None => {
                        let f = group_factors(&group, &every_adapter(adapters))?;
                        cache.mixed = Some(f.clone());
                        f
                    }
                };
                Ok(GroupUpdate::Update(GroupFactors {
                    mask: Some((mask.clone(), group.len() as i32)),
                    ..f
                }))
            }
        }
    }

    /// The output of the sites `sites` (one linear layer's, or a stacked product's in its
    /// order; `product` their matrix, no bias) for input `x` through a widened product
    /// ([`widened`]), then `epilogue`, when this pass takes one: the switch is on, `x` and the
    /// matrix fit, a row's adapter changes one of the sites and no loaded adapter is DoRA at
    /// them. `None`: the caller computes the product and the update.
    pub(crate) fn widened_group(
        &self,
        sites: &[usize],
        product: &MatrixCell,
        x: &Array,
        epilogue: Epilogue<'_>,
    ) -> Result<Option<WidenedPass>, Exception> {
        if !self.engaged.load(Ordering::Acquire) {
            return Ok(None);
        }
        // Read before the table's lock is taken: a cell's holder takes no other lock, and the
        // cell is read and replaced below while the table's is held.
        if !product.with(|m| widened::applies(x, m)) {
            return Ok(None);
        }
        let mut guard = self.lock();
        let state = &mut *guard;
        let group: Vec<&Site> = sites.iter().map(|&i| &state.sites[i]).collect();
        if !widens(&group, &state.selection) {
            return Ok(None);
        }
        drop(group);
        let Some(mask) = widened_mask(state)? else {
            return Ok(None);
        };
        let cache = group_cache(&mut state.groups, sites);
        let rebuilt = cache.widened.is_none();
        if rebuilt {
            let group: Vec<&Site> = sites.iter().map(|&i| &state.sites[i]).collect();
            let f = group_factors(&group, &every_adapter(&state.adapters))?;
            let (w, base_rows) = Widened::new(product.get().weight(), &f.a, f.b)?;
            // The layer holds the widened buffer's first rows from now on, so that the base's
            // weights are held once (the old buffer goes with its last view).
            product.replace(Matrix::Dense(base_rows));
            cache.widened = Some(w);
        }
        let w = cache.widened.as_ref().expect("built above");
        let output = w.output(x, (&mask, sites.len() as i32), epilogue)?;
        Ok(Some(WidenedPass { output, rebuilt }))
    }

    /// How many groups of sites hold a widened matrix.
    #[cfg(test)]
    pub(crate) fn widened_groups(&self) -> usize {
        let state = self.lock();
        state
            .groups
            .values()
            .filter(|g| g.widened.is_some())
            .count()
    }

    fn register(
        self: &Arc<Self>,
        prefix: &str,
        in_dims: i32,
        out_dims: i32,
        experts: Option<i32>,
    ) -> LoraSite {
        let mut state = self.lock();
        let site = Arc::new(SiteRef {
            table: self.clone(),
            index: state.sites.len(),
        });
        let adapters = state.adapters.len();
        state.sites.push(Site {
            prefix: prefix.to_owned(),
            in_dims,
            out_dims,
            experts,
            alive: Arc::downgrade(&site),
            factors: vec![None; adapters],
            stacked: None,
        });
        LoraSite(site)
    }

    /// The output of site `index` for input `x`: `y` (`x @ W.T`, the base layer's matmul),
    /// this pass's adapter update, and the layer's `bias`.
    fn apply(
        &self,
        index: usize,
        x: &Array,
        y: Array,
        matrix: &Matrix,
        bias: Option<&Array>,
    ) -> Result<Array, Exception> {
        let with_bias = |y: Array| match bias {
            Some(b) => y.add(b),
            None => Ok(y),
        };
        if !self.engaged.load(Ordering::Acquire) {
            return with_bias(y);
        }
        let mut guard = self.lock();
        let state = &mut *guard;
        if let Some(e) = state.sites[index].experts {
            return Err(Exception::custom(format!(
                "{}: an expert stack ({e} experts) was called as one linear layer",
                state.sites[index].prefix
            )));
        }
        // mlx-lm's `LoRALinear`: `linear(x) + (scale * z).astype(x.dtype)`, the scale a
        // Python float (weakly typed: it takes z's dtype). `DoRALinear`: `(x @ W.T + that)`
        // times the rescale in x's dtype, then the bias.
        let lora = |y: Array, update: Array| with_bias(y)?.add(&update.as_dtype(x.dtype())?);
        let dora = |y: Array, update: Array, rescale: &Array| {
            let out = y.add(&update.as_dtype(x.dtype())?)?;
            with_bias(out.multiply(&rescale.as_dtype(x.dtype())?)?)
        };
        // A served LoRA update, `((x @ A) * mask) @ B` with the scale in `B`
        // (`group::add_served`).
        let served_lora = |y: Array, a: &Array, b: &Array, mask: Option<&Array>| {
            super::group::add_served(x, a, b, mask.map(|m| (m, 1)), with_bias(y)?)
        };
        match &state.selection {
            Selection::Base => with_bias(y),
            Selection::One(i) => {
                let Some(f) = &mut state.sites[index].factors[*i] else {
                    return with_bias(y);
                };
                let (a, b) = (f.a.clone(), f.b.clone());
                match f.served_rescale(matrix)? {
                    Some(rescale) => dora(y, x.matmul(&a)?.matmul(&b)?, rescale),
                    None => served_lora(y, &a, &b, None),
                }
            }
            Selection::Training {
                factors,
                scale,
                dropout,
            } => {
                let Some(Some(f)) = factors.get(index) else {
                    return with_bias(y);
                };
                let input = training_dropout(x, index, dropout.as_ref())?;
                let z = input.matmul(&f.a)?.matmul(&f.b)?;
                let update = z.multiply(&Array::from_f32(*scale).as_dtype(z.dtype())?)?;
                match &f.m {
                    Some(m) => {
                        let weight = dora::dense_weight(matrix)?;
                        dora(y, update, &dora::rescale(m, &weight, &f.a, &f.b, *scale)?)
                    }
                    None => lora(y, update),
                }
            }
            Selection::Mixed(Mixed {
                slots,
                used,
                mask,
                rows,
            }) => {
                if x.ndim() != 3 || x.shape()[0] != *rows {
                    return Err(Exception::custom(format!(
                        "a linear layer with adapters got input {:?} in a pass of {rows} rows \
                         of different adapters; rows must be the first axis of a [B, L, in] \
                         input",
                        x.shape()
                    )));
                }
                let site = &mut state.sites[index];
                if used.iter().all(|&i| site.factors[i].is_none()) {
                    return with_bias(y);
                }
                if site.stacked.is_none() {
                    site.stacked = Some(stacked(site, matrix, &every_adapter(&state.adapters))?);
                }
                let s = site.stacked.as_ref().expect("built above");
                // Every adapter's `x @ A` at once, each row keeping its own adapter's columns;
                // the other adapters' (and a base row's) are zero and add nothing through `B`.
                let Some((rescales, is_dora)) = &s.dora else {
                    return served_lora(y, &s.a, &s.b, Some(mask));
                };
                let update = x.matmul(&s.a)?.multiply(mask)?.matmul(&s.b)?;
                // Rows of LoRA adapters and of the base take a rescale of one (exact); with a
                // bias, they keep LoRA's order of additions and DoRA rows theirs.
                let rescale = rescales.take_axis(slots, 0)?;
                match bias {
                    None => dora(y, update, &rescale),
                    Some(_) => {
                        let is_dora = is_dora.take_axis(slots, 0)?;
                        let as_dora = dora(y.clone(), update.clone(), &rescale)?;
                        mlx_rs::ops::select(&is_dora, &as_dora, &lora(y, update)?)
                    }
                }
            }
        }
    }

    /// Per `(token, expert)` pair of `indices` (`[B, ..., k]`, rows first), its row's adapter
    /// slot, when this pass mixes rows of different adapters (`None` otherwise: the
    /// sites then need no per-pair information).
    fn pair_adapters(&self, indices: &Array) -> Result<Option<PairAdapters>, Exception> {
        if !self.engaged.load(Ordering::Acquire) {
            return Ok(None);
        }
        match &self.lock().selection {
            Selection::Mixed(Mixed { slots, rows, .. }) => {
                PairAdapters::of_rows(slots, *rows, indices).map(Some)
            }
            _ => Ok(None),
        }
    }

    /// The output of expert-stack site `index`: `y` (the experts' projection of `x` for the
    /// expert ids `indices`, bias included) plus this pass's update, as mlx-lm's
    /// `LoRASwitchLinear`: `y + (scale * z).astype(x.dtype)` with `z` the two gathered
    /// matmuls of each pair's expert factors (a served adapter's `B` carries its scale).
    /// `pairs`: [`Self::pair_adapters`] of the
    /// pass, in the order of `indices`.
    fn apply_experts(
        &self,
        index: usize,
        x: &Array,
        y: Array,
        indices: &Array,
        sorted: bool,
        pairs: Option<&PairAdapters>,
    ) -> Result<Array, Exception> {
        if !self.engaged.load(Ordering::Acquire) {
            return Ok(y);
        }
        let mut guard = self.lock();
        let state = &mut *guard;
        let add = |update: Array| y.add(&update.as_dtype(x.dtype())?);
        let scaled =
            |z: Array, scale: f32| z.multiply(&Array::from_f32(scale).as_dtype(z.dtype())?);
        match &state.selection {
            Selection::Base => Ok(y),
            Selection::One(i) => {
                let Some(f) = &state.sites[index].factors[*i] else {
                    return Ok(y);
                };
                add(experts::low_rank(x, &f.a, &f.b, indices, sorted)?)
            }
            Selection::Training {
                factors,
                scale,
                dropout,
            } => {
                let Some(Some(f)) = factors.get(index) else {
                    return Ok(y);
                };
                let input = training_dropout(x, index, dropout.as_ref())?;
                let z = experts::low_rank(&input, &f.a, &f.b, indices, sorted)?;
                add(scaled(z, *scale)?)
            }
            Selection::Mixed { .. } => {
                let pairs = pairs.ok_or_else(|| {
                    Exception::custom(
                        "an expert stack in a pass of rows of different adapters got no \
                         adapter per (token, expert) pair",
                    )
                })?;
                let site = &mut state.sites[index];
                if site.factors.iter().all(Option::is_none) {
                    return Ok(y);
                }
                let experts = site.experts.unwrap_or(1);
                if site.stacked.is_none() {
                    let factors: Vec<Option<(&Array, &Array)>> = site
                        .factors
                        .iter()
                        .map(|f| f.as_ref().map(|f| (&f.a, &f.b)))
                        .collect();
                    let (a, b) = experts::stacked(&factors, experts, site.in_dims, site.out_dims)?;
                    mlx_rs::transforms::eval([&a, &b])?;
                    site.stacked = Some(Stacked { a, b, dora: None });
                }
                let s = site.stacked.as_ref().expect("built above");
                add(experts::mixed_update(
                    x, &s.a, &s.b, experts, indices, pairs,
                )?)
            }
        }
    }
}

/// A training step's LoRA input at site `index`: `x` under dropout (mlx-lm's `nn.Dropout` on
/// the input of `lora_a`), the mask drawn from the step's key with the site's index added to
/// its second word (an op on the key, so it stays an input of a compiled step).
fn training_dropout(
    x: &Array,
    index: usize,
    dropout: Option<&TrainingDropout>,
) -> Result<Array, Exception> {
    match dropout {
        Some(d) if d.p > 0.0 => {
            let fold = Array::from_slice(&[0u32, (index as u32).wrapping_mul(0x9e37_79b9)], &[2]);
            let key = d.key.add(&fold)?;
            let keep = Array::from_f32(1.0 - d.p);
            let mask = mlx_rs::random::bernoulli(&keep, x.shape(), &key)?;
            x.multiply(&mask)?
                .multiply(&Array::from_f32(1.0 / (1.0 - d.p)).as_dtype(x.dtype())?)
        }
        _ => Ok(x.clone()),
    }
}

/// An adapter name must be usable in `"<base>:<adapter>"` and in a URL path.
fn check_name(name: &str) -> Result<(), AdapterError> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(())
    } else {
        Err(AdapterError::Invalid(format!(
            "adapter name {name:?}: use 1 to 128 of the characters A-Z a-z 0-9 - _ ."
        )))
    }
}

/// The selection of a pass whose rows take different adapters: `slots` (per row, 0 or the
/// loaded adapter's index + 1) and the mask of each row's own adapter's columns among every
/// loaded adapter's (`adapters`), `used` the adapters the rows take.
fn mixed_selection(
    adapters: &[Loaded],
    slots: &[i32],
    used: Vec<usize>,
) -> Result<Mixed, Exception> {
    // Each loaded adapter's columns in the sites' side-by-side factors.
    let mut offsets = Vec::with_capacity(adapters.len());
    let mut width = 0;
    for loaded in adapters {
        offsets.push(width);
        width += loaded.summary.rank;
    }
    let mut mask = vec![0.0f32; slots.len() * width];
    for (r, &s) in slots.iter().enumerate() {
        if s > 0 {
            let i = s as usize - 1;
            let start = r * width + offsets[i];
            mask[start..start + adapters[i].summary.rank].fill(1.0);
        }
    }
    let b = slots.len() as i32;
    let dtypes: Vec<Dtype> = adapters.iter().map(|a| a.dtype).collect();
    let mask = Array::from_slice(&mask, &[b, 1, width as i32]);
    // (A cast, when the adapters are not float32, is one op the pass's sites share.)
    let mask = mask.as_dtype(common_dtype(&dtypes))?;
    Ok(Mixed {
        slots: Array::from_slice(slots, &[b]),
        used,
        mask,
        rows: b,
    })
}

/// The dtype of adapters' factors side by side: theirs when they agree, else float32 (the
/// widest).
fn common_dtype(dtypes: &[Dtype]) -> Dtype {
    match dtypes.first() {
        Some(d) if dtypes.iter().all(|x| x == d) => *d,
        _ => Dtype::Float32,
    }
}

/// A linear site's factors over the adapters `adapters` (each one's index, rank and dtype:
/// [`every_adapter`]) side by side, `A` `[in, R]` and `B` `[R, out]`, each
/// adapter's `rank` columns (rows of `B`) in that order, zeros for an adapter that leaves the
/// site alone, in [`common_dtype`]; with DoRA adapters among the loaded ones, their rescales
/// (over every loaded adapter, gathered per row by slot). The side-by-side factors are left
/// to the pass that asked for them to compute (no wait here).
fn stacked(
    site: &mut Site,
    matrix: &Matrix,
    adapters: &[(usize, usize, Dtype)],
) -> Result<Stacked, Exception> {
    let (a, b) = side_by_side_factors(site, adapters)?;
    let n_out = site.out_dims;
    let dora = if site.factors.iter().flatten().any(|f| f.m.is_some()) {
        let ones = mlx_rs::ops::ones::<f32>(&[1, n_out])?;
        let mut rescales = vec![ones.clone()];
        let mut is_dora = vec![false];
        for f in site.factors.iter_mut() {
            match f.as_mut().map(|f| f.served_rescale(matrix)).transpose()? {
                Some(Some(r)) => {
                    rescales.push(r.as_dtype(Dtype::Float32)?.reshape(&[1, n_out])?);
                    is_dora.push(true);
                }
                _ => {
                    rescales.push(ones.clone());
                    is_dora.push(false);
                }
            }
        }
        let n = is_dora.len() as i32;
        Some((
            stack(&rescales, 0)?,
            Array::from_slice(&is_dora, &[n, 1, 1]),
        ))
    } else {
        None
    };
    let out = Stacked { a, b, dora };
    if let Some((r, d)) = &out.dora {
        mlx_rs::transforms::eval([r, d])?;
    }
    Ok(out)
}

/// Every loaded adapter's index, rank and dtype, in load order: the columns of the factors of
/// passes that mix rows ([`Mixed::mask`]).
fn every_adapter(loaded: &[Loaded]) -> Vec<(usize, usize, Dtype)> {
    loaded
        .iter()
        .enumerate()
        .map(|(i, a)| (i, a.summary.rank, a.dtype))
        .collect()
}

/// A linear site's LoRA factors over `adapters` (each one's index, rank and dtype) side by
/// side, `A` `[in, R]` and `B` `[R, out]`, each adapter's `rank` columns (rows of `B`) in that
/// order, zeros for an adapter that leaves the site alone, in [`common_dtype`].
fn side_by_side_factors(
    site: &Site,
    adapters: &[(usize, usize, Dtype)],
) -> Result<(Array, Array), Exception> {
    let dtypes: Vec<Dtype> = adapters.iter().map(|(_, _, d)| *d).collect();
    let dtype = common_dtype(&dtypes);
    let (n_in, n_out) = (site.in_dims, site.out_dims);
    let mut a_parts = Vec::with_capacity(adapters.len());
    let mut b_parts = Vec::with_capacity(adapters.len());
    for (i, rank, _) in adapters {
        match &site.factors[*i] {
            None => {
                a_parts.push(zeros_dtype(&[n_in, *rank as i32], dtype)?);
                b_parts.push(zeros_dtype(&[*rank as i32, n_out], dtype)?);
            }
            Some(f) => {
                a_parts.push(f.a.as_dtype(dtype)?);
                b_parts.push(f.b.as_dtype(dtype)?);
            }
        }
    }
    Ok((concatenate(&a_parts, 1)?, concatenate(&b_parts, 0)?))
}

/// Whether `sites` take a widened product in a pass of `selection`: one adapter or rows of
/// several, some row's adapter changes one of the sites, and no loaded adapter is DoRA at
/// any of them (its rescale needs each layer's own output) nor any site an expert stack.
fn widens(sites: &[&Site], selection: &Selection) -> bool {
    let plain =
        |s: &&Site| s.experts.is_none() && s.factors.iter().flatten().all(|f| f.m.is_none());
    let takes = |i: usize| sites.iter().any(|s| s.factors[i].is_some());
    sites.iter().all(plain)
        && match selection {
            Selection::One(i) => takes(*i),
            Selection::Mixed(Mixed { used, .. }) => used.iter().any(|&i| takes(i)),
            Selection::Base | Selection::Training { .. } => false,
        }
}

/// The mask of this pass's rows over every loaded adapter's columns, for a widened product:
/// a mixed pass's own, or (every row taking adapter `i`) `i`'s columns `[1, 1, R]`, made once
/// per adapter. `None` for a selection that takes none.
fn widened_mask(state: &mut State) -> Result<Option<Array>, Exception> {
    match &state.selection {
        Selection::Mixed(Mixed { mask, .. }) => Ok(Some(mask.clone())),
        Selection::One(i) => {
            let i = *i;
            if let Some(m) = state.one_masks.get(&i) {
                return Ok(Some(m.clone()));
            }
            let m = mixed_selection(&state.adapters, &[i as i32 + 1], vec![i])?.mask;
            m.eval()?;
            state.one_masks.insert(i, m.clone());
            Ok(Some(m))
        }
        Selection::Base | Selection::Training { .. } => Ok(None),
    }
}

/// The cache of the group `sites`, made empty on its first use (a lookup per pass otherwise:
/// no key is allocated on the adapter rows' hot path).
fn group_cache<'g>(
    groups: &'g mut HashMap<Vec<usize>, GroupCache>,
    sites: &[usize],
) -> &'g mut GroupCache {
    if !groups.contains_key(sites) {
        groups.insert(sites.to_vec(), GroupCache::default());
    }
    groups.get_mut(sites).expect("inserted above")
}

/// The factors of linear sites computed as one stacked product, over `adapters` (each one's
/// index, rank and dtype): each site's side by side ([`side_by_side_factors`]), then the
/// sites' `A` side by side and their `B` block-diagonal ([`super::group`]), no mask yet.
fn group_factors(
    sites: &[&Site],
    adapters: &[(usize, usize, Dtype)],
) -> Result<GroupFactors, Exception> {
    let dtypes: Vec<Dtype> = adapters.iter().map(|(_, _, d)| *d).collect();
    let dtype = common_dtype(&dtypes);
    let (mut a, mut b) = (
        Vec::with_capacity(sites.len()),
        Vec::with_capacity(sites.len()),
    );
    for site in sites {
        let (sa, sb) = side_by_side_factors(site, adapters)?;
        a.push(sa);
        b.push(sb);
    }
    Ok(GroupFactors {
        a: group::side_by_side(&a, dtype)?,
        b: group::block_diagonal(&b, dtype)?,
        mask: None,
    })
}

/// The selection of the forward passes built while it lives (see [`AdapterTable::select`]);
/// dropping it returns every linear to the base model.
pub struct Selected<'a> {
    table: Option<&'a AdapterTable>,
}

impl Selected<'_> {
    /// The selection of a pass with no adapter rows on a model without a table.
    pub fn none() -> Self {
        Self { table: None }
    }
}

impl Drop for Selected<'_> {
    fn drop(&mut self) {
        if let Some(table) = self.table {
            table.engaged.store(false, Ordering::Release);
            table.lock().selection = Selection::Base;
        }
    }
}

/// A linear layer's entry in its model's [`AdapterTable`] (one pointer: it sits in every
/// linear layer).
pub struct LoraSite(Arc<SiteRef>);

struct SiteRef {
    table: Arc<AdapterTable>,
    index: usize,
}

impl fmt::Debug for LoraSite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoraSite")
            .field("index", &self.0.index)
            .finish()
    }
}

impl LoraSite {
    /// Whether the current pass selects an adapter for some row (no lock: one atomic load).
    pub fn engaged(&self) -> bool {
        self.0.table.engaged.load(Ordering::Acquire)
    }

    /// When every one of `sites` is in one table: that table and their indices, for
    /// [`AdapterTable::group_update`]; `None` when they are in different tables.
    pub fn group<'s>(sites: &[&'s LoraSite]) -> Option<(&'s AdapterTable, Vec<usize>)> {
        let first = sites.first()?;
        sites
            .iter()
            .all(|s| Arc::ptr_eq(&s.0.table, &first.0.table))
            .then(|| (&*first.0.table, sites.iter().map(|s| s.0.index).collect()))
    }

    /// The layer's output for `x`: `y` (`x @ W.T` by the layer's `matrix`), the update of
    /// the adapters selected for this pass, and the layer's `bias` (LoRA adds the update
    /// after the bias; DoRA rescales before it). Without a selection, `y + bias`.
    pub fn apply(
        &self,
        x: &Array,
        y: Array,
        matrix: &Matrix,
        bias: Option<&Array>,
    ) -> Result<Array, Exception> {
        self.0.table.apply(self.0.index, x, y, matrix, bias)
    }

    /// The layer's output for `x` through a widened product ([`widened`]), bias-free layers
    /// only, when this pass takes one; `None`: the caller computes `x @ W.T` and
    /// [`Self::apply`]s the update. No lock for a pass without adapter rows.
    pub fn widened(
        &self,
        x: &Array,
        matrix: &MatrixCell,
        epilogue: Epilogue<'_>,
    ) -> Result<Option<WidenedPass>, Exception> {
        if !self.engaged() {
            return Ok(None);
        }
        self.0
            .table
            .widened_group(&[self.0.index], matrix, x, epilogue)
    }

    /// An expert stack's output for `x` and the expert ids `indices` (`sorted`: sorted by
    /// expert): `y` (the experts' projection, bias included) plus the update of the adapters
    /// selected for this pass, each pair by its expert's factors. `pairs`: the pass's
    /// [`Self::pair_adapters`] in the order of `indices`.
    pub fn apply_experts(
        &self,
        x: &Array,
        y: Array,
        indices: &Array,
        sorted: bool,
        pairs: Option<&PairAdapters>,
    ) -> Result<Array, Exception> {
        self.0
            .table
            .apply_experts(self.0.index, x, y, indices, sorted, pairs)
    }

    /// When this pass mixes rows of different adapters: each `(token, expert)` pair's adapter
    /// (`indices` `[B, ..., k]`, the router's choice, rows first). An expert block takes it
    /// once before it sorts the pairs, and permutes it with them.
    pub fn pair_adapters(&self, indices: &Array) -> Result<Option<PairAdapters>, Exception> {
        self.0.table.pair_adapters(indices)
    }
}

thread_local! {
    /// The table of the model being loaded on this thread ([`loading_into`]).
    static LOADING: RefCell<Option<Arc<AdapterTable>>> = const { RefCell::new(None) };
}

/// While the returned scope lives, linear layers loaded on this thread register in `table`.
pub fn loading_into(table: Arc<AdapterTable>) -> LoadScope {
    let previous = LOADING.with(|l| l.borrow_mut().replace(table));
    LoadScope { previous }
}

/// Ends the registration [`loading_into`] began (restoring an outer one: a draft model loads
/// while no main model does, but the scope nests correctly either way).
pub struct LoadScope {
    previous: Option<Arc<AdapterTable>>,
}

impl Drop for LoadScope {
    fn drop(&mut self) {
        let previous = self.previous.take();
        LOADING.with(|l| *l.borrow_mut() = previous);
    }
}

/// Registers the linear layer `prefix` with weight `matrix` in the table of the model being
/// loaded, if a load scope is open.
pub fn site_for(prefix: &str, matrix: &Matrix) -> Option<LoraSite> {
    let table = LOADING.with(|l| l.borrow().clone())?;
    // A linear `[out, in]`, or an expert stack `[E, out, in]` (a `SwitchLinear`; one that a
    // family takes apart after loading drops its site, and adapters naming it are refused).
    let (experts, out_dims, packed) = match *matrix.weight().shape() {
        [out, packed] => (None, out, packed),
        [e, out, packed] => (Some(e), out, packed),
        _ => return None,
    };
    let in_dims = match matrix {
        Matrix::Dense(_) => packed,
        Matrix::Quantized(q) => packed * 32 / q.bits,
    };
    Some(table.register(prefix, in_dims, out_dims, experts))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn normal(shape: &[i32], seed: u64, dtype: Dtype) -> Array {
        let key = mlx_rs::random::key(seed).unwrap();
        mlx_rs::random::normal::<f32>(shape, None, None, Some(&key))
            .unwrap()
            .as_dtype(dtype)
            .unwrap()
    }

    /// The ops (graph nodes not yet evaluated) that `out` needs, as MLX prints the graph, and
    /// those of them that compute (not a view: a reshape of a contiguous array, a transpose,
    /// a broadcast): on a GPU, the kernel launches.
    fn ops(out: &Array) -> (usize, usize) {
        let counts = crate::graph_ops::op_counts(out);
        (counts.total(), counts.computing())
    }

    /// A table with `sites` linear sites `[d, d]` of weight `w` and LoRA adapters of `ranks`
    /// (factors in `dtype`, scale 2 + i), loaded from files as served.
    fn table_with(
        w: &Array,
        sites: usize,
        ranks: &[i32],
        dtype: Dtype,
    ) -> (
        Arc<AdapterTable>,
        Vec<LoraSite>,
        Vec<AdapterId>,
        tempfile::TempDir,
    ) {
        let d = w.shape()[0];
        let table = Arc::new(AdapterTable::new());
        let name = |s: usize| format!("model.layers.{s}.self_attn.q_proj");
        let lora_sites = {
            let _scope = loading_into(table.clone());
            (0..sites)
                .map(|s| site_for(&name(s), &Matrix::Dense(w.clone())).unwrap())
                .collect()
        };
        let dir = tempfile::tempdir().unwrap();
        let mut ids = Vec::new();
        for (i, &r) in ranks.iter().enumerate() {
            let path = dir.path().join(format!("a{i}"));
            std::fs::create_dir_all(&path).unwrap();
            let config = format!(
                r#"{{"fine_tune_type": "lora", "lora_parameters": {{"rank": {r}, "scale": {}}}}}"#,
                2.0 + i as f32
            );
            std::fs::write(path.join("adapter_config.json"), config).unwrap();
            let mut tensors = Vec::new();
            for s in 0..sites {
                let seed = (100 * i + s) as u64;
                let a = normal(&[d, r], 2 * seed, dtype);
                let small = Array::from_f32(0.1).as_dtype(dtype).unwrap();
                let b = normal(&[r, d], 2 * seed + 1, dtype)
                    .multiply(small)
                    .unwrap();
                tensors.push((format!("{}.lora_a", name(s)), a));
                tensors.push((format!("{}.lora_b", name(s)), b));
            }
            Array::save_safetensors(tensors, None, path.join("adapters.safetensors")).unwrap();
            ids.push(table.load(&format!("a{i}"), &path).unwrap());
        }
        (table, lora_sites, ids, dir)
    }

    /// `x` through the chained sites, each `y = x @ W.T` plus its update.
    fn chain(sites: &[LoraSite], matrix: &Matrix, x: &Array) -> Array {
        let mut x = x.clone();
        for site in sites {
            let y = matrix.matmul_t(&x).unwrap();
            x = site.apply(&x, y, matrix, None).unwrap();
        }
        x
    }

    /// 32 rows: adapters 0..4 in turn, every fifth row the base.
    fn mixed_rows(ids: &[AdapterId]) -> Vec<Option<AdapterId>> {
        (0..32).map(|i| (i % 5 < 4).then(|| ids[i % 5])).collect()
    }

    /// A decode step is a launch per op on a GPU: an adapted linear adds, for one adapter,
    /// `x @ A`, `@ B` and the add (with the casts mlx-lm's dtypes call for: `x` to float32
    /// factors' dtype and the update back), and for rows of several, the row mask's multiply
    /// (and its cast, once per pass, where the factors are not float32); the update's cast
    /// and the add are one compiled kernel. Was 6 and 8, then 5 and 6.
    #[test]
    fn an_adapted_linear_adds_few_ops() {
        for (x_dtype, f_dtype, most) in [
            (Dtype::Bfloat16, Dtype::Float32, (4, 5)),
            (Dtype::Bfloat16, Dtype::Bfloat16, (2, 4)),
        ] {
            let w = normal(&[16, 16], 1, x_dtype);
            w.eval().unwrap();
            let (table, sites, ids, _dir) = table_with(&w, 1, &[4, 4, 8, 4], f_dtype);
            let x = normal(&[32, 1, 16], 2, x_dtype);
            x.eval().unwrap();
            let matrix = Matrix::Dense(w.clone());
            let base = ops(&chain(&sites, &matrix, &x));
            let one = {
                let _s = table.select(&[Some(ids[0]); 32]).unwrap();
                ops(&chain(&sites, &matrix, &x))
            };
            let mixed = {
                let _s = table.select(&mixed_rows(&ids)).unwrap();
                // The first pass of a set of adapters also puts their factors side by side.
                chain(&sites, &matrix, &x).eval().unwrap();
                ops(&chain(&sites, &matrix, &x))
            };
            eprintln!(
                "x {x_dtype:?} factors {f_dtype:?}: ops (computing) of the base linear {base:?}; \
                 an adapted linear adds: one adapter {:?}, rows of 4 mixed {:?}",
                (one.0 - base.0, one.1 - base.1),
                (mixed.0 - base.0, mixed.1 - base.1)
            );
            assert!(one.1 - base.1 <= most.0 && mixed.1 - base.1 <= most.1);
        }
    }

    /// Whether `got` is `want` to three bfloat16 ulps of `want`'s largest value (at least 1):
    /// a widened product rounds `x @ A` to bfloat16 where the two products keep float32.
    fn within_bf16(got: &Array, want: &Array) -> bool {
        let f32 = |a: &Array| a.as_dtype(Dtype::Float32).unwrap();
        let size = f32(want).abs().unwrap().max(None).unwrap();
        max_abs_diff(&f32(got), &f32(want)) <= 3.0 / 128.0 * size.item_exact::<f32>().max(1.0)
    }

    /// Through a widened product (`MLXD_LORA_WIDENED`, forced here on the CPU) a linear site
    /// and a stacked group of two give each row its own adapter's update, as the product and
    /// the update computed apart do, to bfloat16's rounding of `x @ A`; a base row is the
    /// base product. The widened matrices are built once per load.
    #[test]
    fn a_widened_product_gives_each_row_its_own_update() {
        let w = normal(&[16, 16], 1, Dtype::Bfloat16);
        let (table, sites, ids, _dir) = table_with(&w, 2, &[4, 2, 8, 4], Dtype::Float32);
        let x = normal(&[32, 1, 16], 2, Dtype::Bfloat16);
        let matrix = Matrix::Dense(w.clone());
        let stacked = Matrix::Dense(concatenate(&[&w, &w], 0).unwrap());
        let (cell, stacked_cell) = (
            MatrixCell::new(matrix.clone()),
            MatrixCell::new(stacked.clone()),
        );
        let f32 = |a: &Array| a.as_dtype(Dtype::Float32).unwrap();
        let close = |got: &Array, want: &Array, what: &str| {
            assert!(within_bf16(got, want), "{what}: {got:?} against {want:?}");
        };
        super::super::widened::force(true);
        let some: Vec<Option<AdapterId>> = (0..32)
            .map(|i| [None, Some(ids[2]), Some(ids[0])][i % 3])
            .collect();
        for (pass, rows) in [vec![Some(ids[1]); 32], mixed_rows(&ids), some]
            .into_iter()
            .enumerate()
        {
            let _s = table.select(&rows).unwrap();
            let widened = sites[0]
                .widened(&x, &cell, Epilogue::None)
                .unwrap()
                .expect("a widened pass");
            assert_eq!(widened.rebuilt, pass == 0, "built by the first pass only");
            let widened = widened.output;
            let apart = sites[0]
                .apply(&x, matrix.matmul_t(&x).unwrap(), &matrix, None)
                .unwrap();
            close(&widened, &apart, "one site");
            let GroupUpdate::Update(f) = table.group_update(&[0, 1]).unwrap() else {
                panic!("rows with adapters got no group update");
            };
            let grouped = table
                .widened_group(&[0, 1], &stacked_cell, &x, Epilogue::None)
                .unwrap()
                .expect("a widened pass")
                .output;
            assert_eq!(grouped.shape(), &[32, 1, 32]);
            close(
                &grouped,
                &f.add_to(&x, stacked.matmul_t(&x).unwrap()).unwrap(),
                "group",
            );
            for (r, row) in rows.iter().enumerate() {
                if row.is_none() {
                    let r = Array::from_int(r as i32);
                    let base = x.take_axis(&r, 0).unwrap().matmul(w.t()).unwrap();
                    let got = widened.take_axis(&r, 0).unwrap();
                    assert_eq!(max_abs_diff(&f32(&got), &f32(&base)), 0.0, "a base row");
                }
            }
        }
        assert_eq!(
            table.widened_groups(),
            2,
            "site 0's and the pair's, built once"
        );
        // Each cell now holds its widened matrix's first rows: the base's values, in the
        // widened buffer (the weight is held once).
        let data = |a: &Array| crate::cache::ssd::tensors::bytes(a).unwrap().as_ptr();
        for (c, group, want) in [
            (&cell, vec![0], &matrix),
            (&stacked_cell, vec![0, 1], &stacked),
        ] {
            let held = c.get();
            assert_eq!(max_abs_diff(&f32(held.weight()), &f32(want.weight())), 0.0);
            let state = table.lock();
            let wide = state.groups[&group].widened.as_ref().unwrap().matrix();
            assert_eq!(
                data(held.weight()),
                data(wide),
                "a view of the widened buffer"
            );
        }
        // A pass without adapter rows, and a float32 layer, take the plain product.
        let _s = table.select(&vec![None; 32]).unwrap();
        assert!(sites[0]
            .widened(&x, &cell, Epilogue::None)
            .unwrap()
            .is_none());
        drop(_s);
        let _s = table.select(&mixed_rows(&ids)).unwrap();
        let x32 = f32(&x);
        let cell32 = MatrixCell::new(Matrix::Dense(f32(&w)));
        assert!(sites[0]
            .widened(&x32, &cell32, Epilogue::None)
            .unwrap()
            .is_none());
        super::super::widened::force(false);
    }

    /// An unload drops the widened matrices, and the next widened pass builds them again
    /// from the layer's rows (a view of the old widened buffer): the base's values survive
    /// every rebuild, and the rows that remain give what they gave.
    #[test]
    fn a_widened_product_is_rebuilt_after_an_unload() {
        let w = normal(&[16, 16], 1, Dtype::Bfloat16);
        let (table, sites, ids, _dir) = table_with(&w, 1, &[4, 2, 8], Dtype::Float32);
        let x = normal(&[32, 1, 16], 2, Dtype::Bfloat16);
        let cell = MatrixCell::new(Matrix::Dense(w.clone()));
        let rows: Vec<Option<AdapterId>> = (0..32).map(|i| Some(ids[[0, 2][i % 2]])).collect();
        super::super::widened::force(true);
        let pass = |rows: &[Option<AdapterId>]| {
            let _s = table.select(rows).unwrap();
            sites[0]
                .widened(&x, &cell, Epilogue::None)
                .unwrap()
                .expect("a widened pass")
        };
        let before = pass(&rows);
        assert!(before.rebuilt);
        let width = |table: &AdapterTable| {
            let state = table.lock();
            state.groups[&vec![0]]
                .widened
                .as_ref()
                .map(|w| w.matrix().shape()[0])
        };
        assert_eq!(width(&table), Some(16 + 4 + 2 + 8));
        table.unload(ids[1]).expect("loaded");
        assert!(table.lock().groups.is_empty(), "an unload drops them");
        let after = pass(&rows);
        assert!(after.rebuilt);
        assert_eq!(width(&table), Some(16 + 4 + 8));
        assert_eq!(max_abs_diff(cell.get().weight(), &w), 0.0);
        assert_eq!(max_abs_diff(&before.output, &after.output), 0.0);
        super::super::widened::force(false);
    }

    /// A model's own linear layers take the widened product through their forward: one
    /// layer alone, and two as one stacked product, give what they give without it.
    #[test]
    fn linear_and_stacked_layers_forward_through_the_widened_product() {
        use crate::models::layers::Linear;
        use crate::models::stacked::Stacked;
        let w = normal(&[16, 16], 1, Dtype::Bfloat16);
        let (table, sites, ids, _dir) = table_with(&w, 2, &[4, 2, 8, 4], Dtype::Float32);
        let x = normal(&[32, 1, 16], 2, Dtype::Bfloat16);
        let close = within_bf16;
        let mut sites = sites.into_iter();
        let layer = |site| Linear::new(Matrix::Dense(w.clone()), None, site);
        let (mut l0, mut l1) = (layer(sites.next()), layer(sites.next()));
        let _s = table.select(&mixed_rows(&ids)).unwrap();
        let widened = || table.widened_groups();
        let plain = l0.forward(&x).unwrap();
        let residual = normal(&[32, 1, 16], 3, Dtype::Bfloat16);
        assert_eq!(widened(), 0);
        super::super::widened::force(true);
        assert!(close(&l0.forward(&x).unwrap(), &plain));
        assert_eq!(widened(), 1, "the layer's site widened");
        // The residual add taken into the site's pass.
        let added = l0.forward_add(&x, &residual).unwrap();
        assert!(close(&added, &residual.add(&plain).unwrap()));
        super::super::widened::force(false);
        let stacked = Stacked::of(&mut [&mut l0, &mut l1])
            .unwrap()
            .expect("two like layers stack");
        let plain = stacked.forward(&x, &[&l0, &l1]).unwrap();
        super::super::widened::force(true);
        let wide = stacked.forward(&x, &[&l0, &l1]).unwrap();
        // SwiGLU of the pair (gate, up) taken into the pass.
        let activated = stacked
            .widened_swiglu(&x, &[&l0, &l1])
            .unwrap()
            .expect("a widened pass");
        let want = crate::models::layers::swiglu(&plain[0], &plain[1]).unwrap();
        assert_eq!(activated.shape(), &[32, 1, 16]);
        assert!(close(&activated, &want));
        super::super::widened::force(false);
        assert!(
            stacked.widened_swiglu(&x, &[&l0, &l1]).unwrap().is_none(),
            "off the widened path the caller activates"
        );
        assert_eq!(wide.len(), 2);
        for (got, want) in wide.iter().zip(&plain) {
            assert_eq!(got.shape(), &[32, 1, 16]);
            assert!(close(got, want));
        }
        assert_eq!(widened(), 2, "the layer's and the stacked pair's");
        // The stacked layers hold their rows of the pair's widened matrix (the buffer they
        // shared before is gone), with the base's values; a base pass gives what it gave.
        let data = |a: &Array| crate::cache::ssd::tensors::bytes(a).unwrap().as_ptr();
        let wide_start = {
            let state = table.lock();
            let w = state.groups[&vec![0, 1]]
                .widened
                .as_ref()
                .unwrap()
                .matrix()
                .clone();
            data(&w) as usize
        };
        for (i, l) in [&l0, &l1].into_iter().enumerate() {
            let held = l.matrix.get();
            assert_eq!(max_abs_diff(held.weight(), &w), 0.0);
            assert_eq!(data(held.weight()) as usize, wide_start + i * 16 * 16 * 2);
        }
        drop(_s);
        let _s = table.select(&vec![None; 32]).unwrap();
        let base = stacked.forward(&x, &[&l0, &l1]).unwrap();
        let want = x.matmul(w.t()).unwrap();
        for part in &base {
            assert_eq!(max_abs_diff(part, &want), 0.0);
        }
    }

    /// Rows taking a set of adapters new to the table build no factors: a mixed pass's factors
    /// hold every loaded adapter, built once (served rows of other adapters join and leave
    /// every few steps, and each rebuild put every group's concatenations into the pass).
    #[test]
    fn a_new_set_of_adapters_among_the_rows_builds_no_factors() {
        let w = normal(&[16, 16], 1, Dtype::Bfloat16);
        let (table, sites, ids, _dir) = table_with(&w, 2, &[4, 4, 8, 4], Dtype::Float32);
        let x = normal(&[32, 1, 16], 2, Dtype::Bfloat16);
        mlx_rs::transforms::eval([&w, &x]).unwrap();
        let matrix = Matrix::Dense(w.clone());
        let y = matrix.matmul_t(&x).unwrap();
        y.eval().unwrap();
        // The two sites one by one, and as one stacked product's group.
        let pass = |rows: &[Option<AdapterId>]| {
            let _s = table.select(rows).unwrap();
            let GroupUpdate::Update(f) = table.group_update(&[0, 1]).unwrap() else {
                panic!("rows with adapters got no group update");
            };
            (chain(&sites, &matrix, &x), f.add_to(&x, y.clone()).unwrap())
        };
        let (chained, grouped) = pass(&mixed_rows(&ids));
        mlx_rs::transforms::eval([&chained, &grouped]).unwrap();
        let (chained, grouped) = pass(&mixed_rows(&ids));
        let every = (ops(&chained), ops(&grouped));
        let two: Vec<Option<AdapterId>> = (0..32).map(|i| Some(ids[[1, 3][i % 2]])).collect();
        let (chained, grouped) = pass(&two);
        assert_eq!((ops(&chained), ops(&grouped)), every);
    }

    /// A pass whose rows take the adapters of the last pass, in the same order, reuses that
    /// pass's row arrays (each made from host data: on CUDA an allocation of unified memory
    /// per decode step); other rows, or a load, make new ones, with the new rows' values.
    #[test]
    fn the_rows_of_the_last_pass_reuse_its_selection() {
        let w = normal(&[16, 16], 1, Dtype::Bfloat16);
        let (table, _sites, ids, dir) = table_with(&w, 1, &[4, 4], Dtype::Float32);
        let selection = |rows: &[Option<AdapterId>]| {
            let _s = table.select(rows).unwrap();
            let Selection::Mixed(m) = &table.lock().selection else {
                panic!("rows of different adapters selected no mix");
            };
            m.slots.eval().unwrap();
            m.mask.eval().unwrap();
            (m.slots.clone(), m.mask.clone())
        };
        let data = |a: &Array| match a.dtype() {
            Dtype::Int32 => a.as_slice::<i32>().as_ptr() as usize,
            _ => a.as_slice::<f32>().as_ptr() as usize,
        };
        let rows = [Some(ids[0]), None, Some(ids[1])];
        let (slots, mask) = selection(&rows);
        let (again, again_mask) = selection(&rows);
        assert_eq!(data(&slots), data(&again), "the same rows: the same arrays");
        assert_eq!(data(&mask), data(&again_mask));
        let other = [Some(ids[1]), None, Some(ids[0])];
        let (swapped, _) = selection(&other);
        assert_ne!(data(&slots), data(&swapped));
        assert_eq!(swapped.as_slice::<i32>(), &[2, 0, 1]);
        // A load changes the columns: the same rows get a new mask, one column per rank.
        let extra = table.load("extra", &dir.path().join("a0")).unwrap();
        let (_, wider) = selection(&other);
        assert_eq!(wider.shape(), &[3, 1, 12]);
        table.unload(extra).unwrap();
        let (_, narrower) = selection(&other);
        assert_eq!(narrower.shape(), &[3, 1, 8]);
        assert_eq!(
            narrower.as_slice::<f32>(),
            &[
                0., 0., 0., 0., 1., 1., 1., 1., 0., 0., 0., 0., 0., 0., 0., 0., 1., 1., 1., 1., 0.,
                0., 0., 0.
            ]
        );
    }

    /// mlx-lm's `LoRALinear` on one row: `y + (scale * (x @ A) @ B).astype(x.dtype)`.
    fn reference(x: &Array, w: &Array, a: &Array, b: &Array, scale: f32) -> Array {
        let z = x.matmul(a).unwrap().matmul(b).unwrap();
        let z = z.multiply(Array::from_f32(scale).as_dtype(z.dtype()).unwrap());
        let y = x.matmul(w.t()).unwrap();
        y.add(z.unwrap().as_dtype(x.dtype()).unwrap()).unwrap()
    }

    fn max_abs_diff(a: &Array, b: &Array) -> f32 {
        let d = a.as_dtype(Dtype::Float32).unwrap();
        let d = d.subtract(b.as_dtype(Dtype::Float32).unwrap()).unwrap();
        d.abs().unwrap().max(None).unwrap().item_exact::<f32>()
    }

    #[test]
    fn each_row_gets_its_own_adapters_update_and_a_base_row_none() {
        for (x_dtype, f_dtype, tolerance) in [
            // Relative: float32 rounding, or two of bfloat16's ulps (the order of the roundings
            // differs, the scale being carried by `B`).
            (Dtype::Float32, Dtype::Float32, 1e-5),
            (Dtype::Bfloat16, Dtype::Float32, 2.0 / 128.0),
            (Dtype::Bfloat16, Dtype::Bfloat16, 2.0 / 128.0),
        ] {
            let w = normal(&[16, 16], 1, x_dtype);
            // Ranks differ: each adapter's columns of the side-by-side factors are its own.
            let ranks = [4, 2, 8, 4];
            let (table, sites, ids, dir) = table_with(&w, 1, &ranks, f_dtype);
            let x = normal(&[32, 1, 16], 2, x_dtype);
            let matrix = Matrix::Dense(w.clone());
            let factors = |i: usize| {
                let path = dir.path().join(format!("a{i}/adapters.safetensors"));
                let t = Array::load_safetensors(path).unwrap();
                let p = "model.layers.0.self_attn.q_proj";
                (
                    t[&format!("{p}.lora_a")].clone(),
                    t[&format!("{p}.lora_b")].clone(),
                )
            };
            let rows = mixed_rows(&ids);
            // One adapter; all four and the base; then two of them (the columns of the two
            // others masked out), then all four again.
            let some: Vec<Option<AdapterId>> = (0..32)
                .map(|i| [None, Some(ids[3]), Some(ids[1])][i % 3])
                .collect();
            let selections = [vec![Some(ids[2]); 32], rows.clone(), some, rows.clone()];
            for selected in selections {
                let _s = table.select(&selected).unwrap();
                let out = sites[0]
                    .apply(&x, matrix.matmul_t(&x).unwrap(), &matrix, None)
                    .unwrap();
                for (r, row) in selected.iter().enumerate() {
                    let xr = x.take_axis(Array::from_int(r as i32), 0).unwrap();
                    let got = out.take_axis(Array::from_int(r as i32), 0).unwrap();
                    let want = match row {
                        None => xr.matmul(w.t()).unwrap(),
                        Some(id) => {
                            let i = ids.iter().position(|x| x == id).unwrap();
                            let (a, b) = factors(i);
                            reference(&xr, &w, &a, &b, 2.0 + i as f32)
                        }
                    };
                    let diff = max_abs_diff(&got, &want);
                    let size = want.abs().unwrap().max(None).unwrap();
                    let size = size.as_dtype(Dtype::Float32).unwrap().item_exact::<f32>();
                    let bound = if row.is_none() {
                        0.0
                    } else {
                        tolerance * size.max(1.0)
                    };
                    assert!(
                        diff <= bound,
                        "x {x_dtype:?}, factors {f_dtype:?}, row {r} ({row:?}): off by {diff}"
                    );
                }
            }
        }
    }

    /// Not a test: the time of passes through 112 small adapted linears (16 layers of 7, as a
    /// 1B model's), 32 rows, base vs one adapter vs 4 adapters mixed; on a CPU at width 64
    /// the per-op cost dominates, as kernel launches do a GPU's decode step.
    #[test]
    #[ignore]
    fn timing() {
        let (x_dtype, f_dtype) = (Dtype::Bfloat16, Dtype::Float32);
        let small = Array::from_f32(0.1).as_dtype(x_dtype).unwrap();
        let w = normal(&[64, 64], 1, x_dtype).multiply(small).unwrap();
        w.eval().unwrap();
        let (table, sites, ids, _dir) = table_with(&w, 112, &[8, 8, 8, 8], f_dtype);
        let x = normal(&[32, 1, 64], 2, x_dtype);
        x.eval().unwrap();
        let matrix = Matrix::Dense(w.clone());
        let time = |rows: Option<Vec<Option<AdapterId>>>| {
            let run = || {
                let _s = rows.as_ref().map(|r| table.select(r).unwrap());
                chain(&sites, &matrix, &x).eval().unwrap();
            };
            for _ in 0..20 {
                run();
            }
            let mut best = f64::MAX;
            for _ in 0..5 {
                let t = std::time::Instant::now();
                for _ in 0..50 {
                    run();
                }
                best = best.min(t.elapsed().as_secs_f64() / 50.0);
            }
            best * 1e3
        };
        let base = time(None);
        let one = time(Some(vec![Some(ids[0]); 32]));
        let mixed = time(Some(mixed_rows(&ids)));
        eprintln!(
            "ms per pass: base {base:.3}, one {one:.3} ({:.2}x base speed), mixed {mixed:.3} \
             ({:.2}x)",
            base / one,
            base / mixed
        );
    }
}
