//! A sampling step as one compiled MLX graph per set of transforms.
//!
//! Built op by op, a sampled step queued some thirty small kernels per decode step (each
//! transform, the noise, the selects), rebuilt the graph on the host every step and uploaded
//! a few scalars. Here the whole step, from the model's logits to the chosen tokens and the
//! rows' next state (noise counters, seen tokens, counts), is one function of device arrays,
//! compiled by MLX once per [`Transforms`] value (and traced once per input shape under it),
//! so its element-wise chains run as fused kernels and a step creates no host array. The
//! per-row parameters are one `[B, COLUMNS]` matrix built when rows join or leave.
//!
//! The graph is the op-by-op sampler's sequence of operations, in the same order and dtypes
//! (see [`super`] for what each transform does), so a seeded row draws the same tokens
//! (`super::snapshot` holds that contract). [`run`] can also evaluate it uncompiled, which
//! the tests compare against.
use std::cell::RefCell;
use std::collections::HashMap;

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{argmax_axis, take_along_axis, IndexOp};
use mlx_rs::ops::{maximum, select, softmax_axis, sort_axis};
use mlx_rs::{Array, Dtype};

use crate::runtime::noise;

/// The columns of the per-row parameter matrix (float32; integers are exact below 2^24).
pub mod column {
    /// Repetition penalty (1 = off).
    pub const REPETITION: i32 = 0;
    pub const PRESENCE: i32 = 1;
    pub const FREQUENCY: i32 = 2;
    /// Temperature, 1 for greedy rows (whose draw is discarded).
    pub const TEMPERATURE: i32 = 3;
    /// Rank of the last token top-k keeps (vocabulary − 1 when off).
    pub const TOP_K_LAST: i32 = 4;
    pub const TOP_P: i32 = 5;
    /// ln(min_p), −∞ when off.
    pub const LOG_MIN_P: i32 = 6;
    /// 1 for a greedy row, 0 for a sampled one.
    pub const GREEDY: i32 = 7;
    /// How many columns there are.
    pub const COUNT: i32 = 8;
}

/// Which transforms a step applies to the whole batch. Each value gets its own compiled
/// graph: a transform no row uses costs nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Transforms {
    pub bias: bool,
    pub repetition: bool,
    /// Presence or frequency penalties.
    pub counts: bool,
    pub mask: bool,
    /// Some row is greedy (temperature 0).
    pub any_greedy: bool,
    /// Some row samples (temperature above 0).
    pub any_sampled: bool,
    pub top_k: bool,
    pub top_p: bool,
    pub min_p: bool,
    /// One token per row, and the rows' state advances past it (`sample`); otherwise several
    /// positions per row and no state changes (`sample_positions`).
    pub advance: bool,
    /// The float32 log-softmax is an output (some row reports log-probabilities).
    pub raw: bool,
}

/// What a step reads, all on the device.
pub struct Inputs<'a> {
    /// `[N, vocab]` in the model's dtype, `N = B × positions`.
    pub logits: &'a Array,
    /// `[1, vocab]` u32 vocabulary ids `0..vocab`.
    pub ids: &'a Array,
    /// `[B, column::COUNT]` float32.
    pub params: &'a Array,
    /// `[B, 1]` u32: seed halves and the index of each row's next generated token.
    pub seed_lo: &'a Array,
    pub seed_hi: &'a Array,
    pub steps: &'a Array,
    /// `[B, vocab]` float32, present exactly when the matching transform is on.
    pub bias: Option<&'a Array>,
    pub seen: Option<&'a Array>,
    pub counts: Option<&'a Array>,
    pub mask: Option<&'a Array>,
}

/// What a step produces, lazily.
pub struct Outputs {
    /// `[N]` u32.
    pub tokens: Array,
    /// `[N, vocab]` float32 log-softmax, when [`Transforms::raw`].
    pub raw: Option<Array>,
    /// The rows' next state, when [`Transforms::advance`] (seen and counts only when kept).
    pub steps: Option<Array>,
    pub seen: Option<Array>,
    pub counts: Option<Array>,
}

type Graph = Box<dyn FnMut(&[Array]) -> Result<Vec<Array>, Exception>>;

thread_local! {
    /// The compiled graphs of this thread (the MLX thread), one per transform set.
    static GRAPHS: RefCell<HashMap<Transforms, Graph>> = RefCell::new(HashMap::new());
}

/// Runs one step: through its compiled graph, or (`compiled == false`) op by op.
pub fn run(t: Transforms, inputs: &Inputs<'_>, compiled: bool) -> Result<Outputs, Exception> {
    let present = [
        (t.bias, inputs.bias.is_some(), "bias"),
        (t.repetition, inputs.seen.is_some(), "seen tokens"),
        (t.counts, inputs.counts.is_some(), "counts"),
        (t.mask, inputs.mask.is_some(), "mask"),
    ];
    if let Some((_, _, name)) = present.iter().find(|(on, given, _)| on != given) {
        return Err(Exception::custom(format!(
            "sampler: the {name} input does not match the transform set {t:?}"
        )));
    }
    let mut args = vec![
        inputs.logits.clone(),
        inputs.ids.clone(),
        inputs.params.clone(),
        inputs.seed_lo.clone(),
        inputs.seed_hi.clone(),
        inputs.steps.clone(),
    ];
    args.extend(
        [inputs.bias, inputs.seen, inputs.counts, inputs.mask]
            .into_iter()
            .flatten()
            .cloned(),
    );
    let outputs = if compiled {
        GRAPHS.with(|cell| {
            let mut graphs = cell.borrow_mut();
            let f = graphs.entry(t).or_insert_with(|| {
                Box::new(mlx_rs::transforms::compile::compile(
                    move |args: &[Array]| graph(t, args),
                    false,
                ))
            });
            f(&args)
        })?
    } else {
        graph(t, &args)?
    };
    let mut outputs = outputs.into_iter();
    let mut next = |what: &str| {
        outputs
            .next()
            .ok_or_else(|| Exception::custom(format!("sampler graph: no {what} output")))
    };
    let tokens = next("tokens")?;
    let raw = t.raw.then(|| next("log-softmax")).transpose()?;
    let steps = t.advance.then(|| next("steps")).transpose()?;
    let seen = (t.advance && t.repetition)
        .then(|| next("seen"))
        .transpose()?;
    let counts = (t.advance && t.counts)
        .then(|| next("counts"))
        .transpose()?;
    Ok(Outputs {
        tokens,
        raw,
        steps,
        seen,
        counts,
    })
}

/// The step itself. Arguments in [`run`]'s order; outputs in [`Outputs`]' order.
fn graph(t: Transforms, args: &[Array]) -> Result<Vec<Array>, Exception> {
    let fixed = 6;
    let optional = [t.bias, t.repetition, t.counts, t.mask]
        .iter()
        .filter(|&&on| on)
        .count();
    if args.len() != fixed + optional {
        return Err(Exception::custom(format!(
            "sampler graph: {} arguments for {t:?}",
            args.len()
        )));
    }
    let (logits, ids, params, lo, hi, steps) =
        (&args[0], &args[1], &args[2], &args[3], &args[4], &args[5]);
    let mut rest = args[fixed..].iter();
    let mut take = |on: bool| if on { rest.next() } else { None };
    let (bias, seen, counts, mask) = (
        take(t.bias),
        take(t.repetition),
        take(t.counts),
        take(t.mask),
    );

    let b = steps.shape()[0];
    let n = logits.shape()[0];
    if b == 0 || n % b != 0 {
        return Err(Exception::custom(format!(
            "sampler graph: {n} logit rows for {b} batch rows"
        )));
    }
    let l = n / b;
    // A batch row's values repeated for each of its `l` positions.
    let per_position = |a: &Array| -> Result<Array, Exception> {
        if l == 1 {
            Ok(a.clone())
        } else {
            Array::repeat_axis::<f32>(a.clone(), l, 0)
        }
    };
    let params = per_position(params)?;
    let col = |c: i32| params.index((.., c..c + 1));

    let logprobs = logits.subtract(logits.logsumexp_axis(-1, true)?)?;
    let raw = logprobs.as_dtype(Dtype::Float32)?;
    let mut x = raw.clone();
    if let Some(bias) = bias {
        x = x.add(per_position(bias)?)?;
    }
    if let Some(seen) = seen {
        let r = col(column::REPETITION);
        let penalised = select(&x.gt(Array::from_f32(0.0))?, x.divide(&r)?, x.multiply(&r)?)?;
        x = select(
            &per_position(seen)?.gt(Array::from_f32(0.0))?,
            &penalised,
            &x,
        )?;
    }
    if let Some(counts) = counts {
        let counts = per_position(counts)?;
        let presence = col(column::PRESENCE);
        let frequency = col(column::FREQUENCY);
        let present = counts.gt(Array::from_f32(0.0))?.as_dtype(Dtype::Float32)?;
        x = x
            .subtract(presence.multiply(&present)?)?
            .subtract(frequency.multiply(&counts)?)?;
    }
    if let Some(mask) = mask {
        x = x.add(per_position(mask)?)?;
    }
    let greedy = if t.any_greedy || !t.any_sampled {
        Some(argmax_axis(&x, -1, None)?.as_dtype(Dtype::Uint32)?)
    } else {
        None
    };
    let tokens = match greedy {
        Some(greedy) if !t.any_sampled => greedy,
        greedy => {
            let sampled = draw(t, &x, &col, (lo, hi, steps), ids, l, &per_position)?;
            match greedy {
                Some(greedy) => {
                    let is_greedy = col(column::GREEDY)
                        .reshape(&[n])?
                        .gt(Array::from_f32(0.5))?;
                    select(&is_greedy, &greedy, &sampled)?
                }
                None => sampled,
            }
        }
    };

    let mut out = vec![tokens.clone()];
    if t.raw {
        out.push(raw);
    }
    if t.advance {
        out.push(steps.add(Array::from_slice(&[1u32], &[1]))?);
        if seen.is_some() || counts.is_some() {
            let one_hot = ids.eq(tokens.reshape(&[b, 1])?)?.as_dtype(Dtype::Float32)?;
            if let Some(seen) = seen {
                out.push(maximum(seen, &one_hot)?);
            }
            if let Some(counts) = counts {
                out.push(counts.add(&one_hot)?);
            }
        }
    }
    Ok(out)
}

/// Temperature, truncation and the Gumbel-max draw for every position (greedy rows too; their
/// draw is discarded).
fn draw(
    t: Transforms,
    x: &Array,
    col: &dyn Fn(i32) -> Array,
    (lo, hi, steps): (&Array, &Array, &Array),
    ids: &Array,
    l: i32,
    per_position: &dyn Fn(&Array) -> Result<Array, Exception>,
) -> Result<Array, Exception> {
    let z = x.divide(col(column::TEMPERATURE))?;
    let mut threshold: Option<Array> = None;
    if t.top_k || t.top_p {
        // Descending order: sort the negation.
        let mut sorted = sort_axis(z.negative()?, -1)?.negative()?;
        if t.top_k {
            let last = col(column::TOP_K_LAST).as_dtype(Dtype::Int32)?;
            threshold = Some(take_along_axis(&sorted, &last, -1)?);
            let rank = ids.as_dtype(Dtype::Int32)?;
            sorted = select(
                &rank.le(&last)?,
                &sorted,
                Array::from_f32(f32::NEG_INFINITY),
            )?;
        }
        if t.top_p {
            let probs = softmax_axis(&sorted, -1, true)?;
            let before = probs.cumsum(-1, None, None)?.subtract(&probs)?;
            let kept = before
                .lt(col(column::TOP_P))?
                .as_dtype(Dtype::Int32)?
                .sum_axis(-1, true)?;
            let last = maximum(kept.subtract(Array::from_int(1))?, Array::from_int(0))?;
            let p = take_along_axis(&sorted, &last, -1)?;
            threshold = Some(match threshold {
                Some(k) => maximum(&k, &p)?,
                None => p,
            });
        }
    }
    if t.min_p {
        let m = z.max_axis(-1, true)?.add(col(column::LOG_MIN_P))?;
        threshold = Some(match threshold {
            Some(k) => maximum(&k, &m)?,
            None => m,
        });
    }
    let z = match threshold {
        Some(th) => select(&z.ge(&th)?, &z, Array::from_f32(f32::NEG_INFINITY))?,
        None => z,
    };
    let g = if l == 1 {
        noise::graph(lo, hi, steps, ids)?
    } else {
        let rows = steps.shape()[0];
        let offsets = Array::arange::<_, u32>(None, l as u32, None)?.reshape(&[1, l])?;
        let steps = steps.add(&offsets)?.reshape(&[rows * l, 1])?;
        noise::graph(&per_position(lo)?, &per_position(hi)?, &steps, ids)?
    };
    argmax_axis(z.add(&g)?, -1, None)?.as_dtype(Dtype::Uint32)
}
