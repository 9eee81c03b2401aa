//! `RunStream`: iterations submitted as their requests arrive, answered in request order,
//! with back-pressure both ways.
//!
//! At most [`PIPELINE`] iterations of a stream wait for their turn, and at most
//! [`PIPELINE`] answers wait for the client to read them: past either, the daemon stops
//! reading the stream and HTTP/2 flow control holds the client back, so a client that
//! never reads cannot make the daemon keep its fetches without bound.
//!
//! The stream never ends with OK unless every request was answered: a request that cannot
//! be decoded ends it with `INVALID_ARGUMENT` naming the request (after the answers to
//! those before it), and a task that fails ends it with `INTERNAL`.

use salus_proto::v1 as pb;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};

use super::buffers::Buffers;
use super::convert::{bounded, run_response};
use super::iterations::{self, Answer};
use super::{BoxStream, PIPELINE, panicked};
use crate::auth::Principal;
use crate::engine::Engine;

/// What the answering side does next, in request order.
enum Next {
    /// Answer the request with this tag once its iteration is done.
    Answer(u64, Answer),
    /// End the stream with this status.
    Fail(Status),
}

type Answers = mpsc::Sender<Result<pb::RunResponse, Status>>;

/// Serves one `RunStream`: its responses.
pub(super) fn run_stream(
    engine: Engine,
    buffers: Buffers,
    principal: Principal,
    requests: Streaming<pb::RunRequest>,
) -> BoxStream<pb::RunResponse> {
    let (answers, responses) = mpsc::channel(PIPELINE);
    let (order, in_order) = mpsc::channel(PIPELINE);
    let submitting = tokio::spawn(submit(engine, buffers, principal, requests, order.clone()));
    tokio::spawn(async move {
        if let Err(error) = submitting.await
            && let Some(status) = panicked(error)
        {
            let _ = order.send(Next::Fail(status)).await;
        }
    });
    let answering = tokio::spawn(answer(in_order, answers.clone()));
    tokio::spawn(async move {
        if let Err(error) = answering.await
            && let Some(status) = panicked(error)
        {
            let _ = answers.send(Err(status)).await;
        }
    });
    Box::pin(ReceiverStream::new(responses).map(|r| r.map_err(bounded)))
}

/// Submits each request's iteration as it arrives; waits while [`PIPELINE`] of them are
/// unanswered.
async fn submit(
    engine: Engine,
    buffers: Buffers,
    principal: Principal,
    mut requests: Streaming<pb::RunRequest>,
    order: mpsc::Sender<Next>,
) {
    let mut index = 0u64;
    let mut last_tag = None;
    while let Some(request) = requests.next().await {
        index += 1;
        let request = match request {
            Ok(request) => request,
            Err(status) => {
                let after = match last_tag {
                    Some(tag) => format!("after the request tagged {tag}"),
                    None => "the first".to_string(),
                };
                let status = Status::new(
                    status.code(),
                    format!("RunStream request {index} ({after}): {}", status.message()),
                );
                let _ = order.send(Next::Fail(status)).await;
                return;
            }
        };
        last_tag = Some(request.tag);
        let tag = request.tag;
        let answer = iterations::submit(&engine, &buffers, principal, request).await;
        if order.send(Next::Answer(tag, answer)).await.is_err() {
            return;
        }
    }
}

/// Answers in request order; waits while [`PIPELINE`] answers are unread.
async fn answer(mut in_order: mpsc::Receiver<Next>, answers: Answers) {
    while let Some(next) = in_order.recv().await {
        let item = match next {
            Next::Answer(tag, answer) => Ok(run_response(tag, answer.await)),
            Next::Fail(status) => Err(status),
        };
        let last = item.is_err();
        if answers.send(item).await.is_err() || last {
            return;
        }
    }
}
