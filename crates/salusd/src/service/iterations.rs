//! One `RunRequest` from arrival to answer: its writes and feeds (carried, or read from
//! the session's feed buffer), the engine's iteration, its fetches (returned, or written
//! to the feed buffer).

use std::future::Future;
use std::pin::Pin;

use salus_proto::v1 as pb;
use tonic::Status;

use super::buffers::{Buffers, FeedBuffer};
use super::convert::whole_tensors;
use crate::auth::Principal;
use crate::engine::{Command, Engine, EngineError, RunResult};

/// The answer to one iteration, once it has run.
pub type Answer = Pin<Box<dyn Future<Output = Result<RunResult, Status>> + Send>>;

/// Where an iteration's fetches go.
struct FetchTo {
    buffer: std::sync::Arc<FeedBuffer>,
    ranges: Vec<pb::BufferRange>,
}

/// Checks `request`, reads its feeds and hands the iteration to the engine; the answer
/// resolves when it has run. A request that fails its checks answers at once (nothing
/// is queued).
pub async fn submit(
    engine: &Engine,
    buffers: &Buffers,
    principal: Principal,
    request: pb::RunRequest,
) -> Answer {
    match prepare(engine, buffers, principal, request).await {
        Ok(answer) => answer,
        Err(status) => Box::pin(std::future::ready(Err(status))),
    }
}

async fn prepare(
    engine: &Engine,
    buffers: &Buffers,
    principal: Principal,
    request: pb::RunRequest,
) -> Result<Answer, Status> {
    let pb::RunRequest {
        session,
        mut feeds,
        writes,
        program,
        feed_ranges,
        fetch_ranges,
        ..
    } = request;
    let writes = whole_tensors(writes).map_err(Status::from)?;
    let needs_buffer = !feed_ranges.is_empty() || !fetch_ranges.is_empty();
    let buffer = if needs_buffer {
        Some(buffers.get(session).ok_or_else(|| {
            Status::failed_precondition(format!(
                "session {session} has no feed buffer attached (AttachBuffer first)"
            ))
        })?)
    } else {
        None
    };
    if !feed_ranges.is_empty() {
        if !feeds.is_empty() {
            return Err(Status::invalid_argument(
                "a RunRequest gives its feeds as bytes or as ranges of the feed buffer, not both",
            ));
        }
        let buffer = buffer.clone().expect("checked above");
        // A large batch: the copy runs off the async workers.
        feeds = tokio::task::spawn_blocking(move || buffer.read(principal, &feed_ranges))
            .await
            .map_err(|e| Status::internal(format!("reading feeds stopped: {e}")))??;
    }
    let fetch_to = match buffer {
        Some(buffer) if !fetch_ranges.is_empty() => {
            buffer.check_fetches(principal, &fetch_ranges)?;
            Some(FetchTo {
                buffer,
                ranges: fetch_ranges,
            })
        }
        _ => None,
    };
    let (reply, answer) = tokio::sync::oneshot::channel();
    engine
        .send(Command::Run {
            principal,
            session,
            program,
            feeds,
            writes,
            fetch_lengths: fetch_to
                .as_ref()
                .map(|f| f.ranges.iter().map(|r| r.length).collect())
                .unwrap_or_default(),
            reply,
        })
        .map_err(Status::from)?;
    Ok(Box::pin(async move {
        let mut result = answer
            .await
            .unwrap_or(Err(EngineError::ShuttingDown))
            .map_err(Status::from)?;
        if let Some(to) = fetch_to {
            let fetches = std::mem::take(&mut result.fetches);
            tokio::task::spawn_blocking(move || to.buffer.write(&fetches, &to.ranges))
                .await
                .map_err(|e| Status::internal(format!("writing fetches stopped: {e}")))??;
        }
        Ok(result)
    }))
}
