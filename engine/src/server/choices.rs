//! The SSE body of a response with several choices (`n`), each its own generation in the
//! batch: every choice's frames as they come, then, after the last choice ends, the usage
//! chunk (when asked) and `[DONE]`. A failing choice ends the body with its error frame.
use std::convert::Infallible;
use std::future::Future;

use axum::body::Bytes;
use axum::response::Response;
use futures::stream::BoxStream;
use futures::StreamExt;
use mlxd_protocol::openai::{Usage, SSE_DONE};

/// What one choice's stream yields: frames, its end (with its usage), or a failure.
pub enum ChoiceEvent {
    Frames(Vec<Bytes>),
    Done(Usage),
    Failed(Bytes),
}

/// Where one choice's stream is.
pub enum ChoiceState<C> {
    Running(Box<C>),
    /// Its last frames are out; its usage follows.
    Ending(Usage),
    Over,
}

/// One choice's events: `step` takes a running choice to its next event and state; a choice
/// that ended then yields its usage, and after that nothing.
pub fn choice_events<C, F, Fut>(choice: C, step: F) -> BoxStream<'static, ChoiceEvent>
where
    C: Send + 'static,
    F: FnMut(Box<C>) -> Fut + Send + 'static,
    Fut: Future<Output = Option<(ChoiceEvent, ChoiceState<C>)>> + Send + 'static,
{
    let start = (ChoiceState::Running(Box::new(choice)), step);
    futures::stream::unfold(start, |(state, mut step)| async move {
        let (event, next) = match state {
            ChoiceState::Running(c) => step(c).await?,
            ChoiceState::Ending(usage) => (ChoiceEvent::Done(usage), ChoiceState::Over),
            ChoiceState::Over => return None,
        };
        Some((event, (next, step)))
    })
    .boxed()
}

/// Usage over all choices: the prompt once, the completions summed.
pub fn total_usage(usages: &[Usage]) -> Usage {
    let mut total = usages.first().copied().unwrap_or_default();
    total.completion_tokens = usages.iter().map(|u| u.completion_tokens).sum();
    total.total_tokens = total.prompt_tokens + total.completion_tokens;
    total
}

/// Shapes the final usage chunk of a stream.
pub type UsageFrame = Box<dyn Fn(Usage) -> Bytes + Send + Sync>;

/// The merged SSE response: `first` frames, then the choices'. `usage_frame` shapes the
/// final usage chunk; `None` sends none.
pub fn merged_sse(
    first: Vec<Bytes>,
    choices: Vec<BoxStream<'static, ChoiceEvent>>,
    usage_frame: Option<UsageFrame>,
) -> Response {
    struct Merge {
        merged: futures::stream::SelectAll<BoxStream<'static, ChoiceEvent>>,
        left: usize,
        usages: Vec<Usage>,
        usage_frame: Option<UsageFrame>,
        over: bool,
    }
    let state = Merge {
        left: choices.len(),
        merged: futures::stream::select_all(choices),
        usages: Vec::new(),
        usage_frame,
        over: false,
    };
    let rest = futures::stream::unfold(state, |mut s| async move {
        if s.over {
            return None;
        }
        loop {
            match s.merged.next().await? {
                ChoiceEvent::Frames(frames) => return Some((Bytes::from(frames.concat()), s)),
                ChoiceEvent::Done(usage) => {
                    s.usages.push(usage);
                    s.left -= 1;
                    if s.left == 0 {
                        s.over = true;
                        let mut tail = Vec::new();
                        if let Some(frame) = &s.usage_frame {
                            tail.extend_from_slice(&frame(total_usage(&s.usages)));
                        }
                        tail.extend_from_slice(format!("data: {SSE_DONE}\n\n").as_bytes());
                        return Some((Bytes::from(tail), s));
                    }
                }
                ChoiceEvent::Failed(frame) => {
                    s.over = true;
                    return Some((frame, s));
                }
            }
        }
    });
    let body = futures::stream::iter(first)
        .chain(rest)
        .map(Ok::<_, Infallible>);
    super::routes::event_stream(body)
}
