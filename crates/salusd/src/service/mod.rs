//! The gRPC services: requests in, engine commands out.
//!
//! This layer is the protocol edge, and the only one that speaks protobuf and gRPC
//! statuses. It authenticates every request, decodes and validates what clients send
//! (graphs, chunks, feeds; `open`) so the engine only ever sees well-formed work, and
//! turns the engine's domain answers and errors into messages and statuses (`convert`).

mod buffers;
mod convert;
mod iterations;
mod missing;
mod open;
mod pipeline;
mod serve;
mod transfer;

use std::pin::Pin;

use salus_core::PolicyKind;
use salus_proto::v1 as pb;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

use crate::auth::{Access, Principal};
use crate::engine::{Command, Engine, NewSession};
use crate::serving::Servers;
use buffers::{Buffers, FeedBuffer};
use convert::run_response;
pub use convert::{MAX_STATUS_MESSAGE, bounded, bounded_message, code, micros};
pub use missing::AnswerMissingMessage;
pub use open::{hints_from_proto, hints_to_proto};

/// Iterations one `RunStream` may have submitted and not yet answered, and answers it may
/// hold that the client has not read yet.
pub const PIPELINE: usize = 16;

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

/// Both services share the engine handle and the access rules.
#[derive(Clone)]
pub struct Service {
    engine: Engine,
    access: Access,
    buffers: Buffers,
    servers: Servers,
}

impl Service {
    /// Services answering from `engine`, authenticating with `access`, serving models
    /// in `servers`.
    pub fn new(engine: Engine, access: Access, servers: Servers) -> Service {
        Service {
            engine,
            access,
            buffers: Buffers::default(),
            servers,
        }
    }

    fn principal<T>(&self, request: &Request<T>) -> Result<Principal, Status> {
        self.access.principal(request).map_err(bounded)
    }
}

/// The status a stream ends with when the task serving it panicked (a bug): never the OK
/// a client would take for success. `None` when the task was only cancelled.
fn panicked(error: tokio::task::JoinError) -> Option<Status> {
    if !error.is_panic() {
        return None;
    }
    let panic = error.into_panic();
    let what = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_default();
    tracing::error!(%what, "a task serving a stream panicked");
    Some(Status::internal(bounded_message(&format!(
        "salusd failed serving this stream (a bug; please report it): {what}"
    ))))
}

/// Ends a session's lease when its update stream is dropped (the client went away).
struct Lease {
    engine: Engine,
    buffers: Buffers,
    servers: Servers,
    owner: Principal,
    session: Option<u64>,
    updates: UnboundedReceiverStream<Result<pb::SessionUpdate, Status>>,
}

impl Stream for Lease {
    type Item = Result<pb::SessionUpdate, Status>;

    fn poll_next(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        let next = Pin::new(&mut self.updates).poll_next(cx);
        if let std::task::Poll::Ready(Some(Ok(pb::SessionUpdate {
            update: Some(pb::session_update::Update::Opened(opened)),
        }))) = &next
        {
            self.session = Some(opened.session);
        }
        next.map(|item| item.map(|update| update.map_err(bounded)))
    }
}

fn end_lease(
    engine: &Engine,
    buffers: &Buffers,
    servers: &Servers,
    owner: Principal,
    session: u64,
) {
    buffers.detach(session);
    servers.stop(session);
    let _ = engine.send(Command::Close {
        principal: owner,
        session,
        reply: None,
    });
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(session) = self.session {
            end_lease(
                &self.engine,
                &self.buffers,
                &self.servers,
                self.owner,
                session,
            );
        }
    }
}

type UpdateSender = mpsc::UnboundedSender<Result<pb::SessionUpdate, Status>>;

/// What an `Open` stream brought: a new session, or a client back for a restored one.
enum Received {
    Session(Box<NewSession>),
    Reattached(u64),
}

/// The first message of an `Open` stream.
async fn first_message(
    stream: &mut Streaming<pb::OpenRequest>,
) -> Result<pb::open_request::Item, Status> {
    stream
        .next()
        .await
        .ok_or_else(|| Status::invalid_argument("the Open stream ended before `open`"))?
        .map_err(bounded)?
        .item
        .ok_or_else(|| Status::invalid_argument("an empty Open message"))
}

/// Reads an `Open` stream's session (or its `reattach`).
async fn receive(
    engine: &Engine,
    owner: Principal,
    stream: &mut Streaming<pb::OpenRequest>,
    updates: UpdateSender,
) -> Result<Received, Status> {
    match first_message(stream).await? {
        pb::open_request::Item::Open(open) => {
            open::receive_session(engine, owner, open, stream, updates)
                .await
                .map(|session| Received::Session(Box::new(session)))
        }
        pb::open_request::Item::Reattach(reattach) => {
            let sink = convert::update_sink(updates);
            engine
                .ask(|reply| Command::Reattach {
                    principal: owner,
                    session: reattach.session,
                    token: reattach.token,
                    updates: sink,
                    reply,
                })
                .await?;
            Ok(Received::Reattached(reattach.session))
        }
        _ => Err(Status::invalid_argument(
            "the first Open message must be `open` or `reattach`",
        )),
    }
}

/// Receives a session from its `Open` stream (within `--open-timeout`), hands it to the
/// engine (or reattaches the client to a restored one), and holds its lease until the
/// client ends its side or goes away.
async fn hold_lease(
    engine: Engine,
    buffers: Buffers,
    servers: Servers,
    owner: Principal,
    stream: Streaming<pb::OpenRequest>,
    updates: UpdateSender,
) {
    let timeout = engine.open_timeout();
    // On its own task, so that a panic answers the stream rather than ending it with OK.
    let receiving = tokio::spawn({
        let (engine, updates) = (engine.clone(), updates.clone());
        async move {
            let mut stream = stream;
            let received = receive(&engine, owner, &mut stream, updates);
            (tokio::time::timeout(timeout, received).await, stream)
        }
    });
    let (received, mut stream) = match receiving.await {
        Ok(done) => done,
        Err(error) => {
            if let Some(status) = panicked(error) {
                let _ = updates.send(Err(status));
            }
            return;
        }
    };
    let id = match received {
        Ok(Ok(Received::Session(session))) => {
            let id = session.id;
            if let Err(error) = engine.send(Command::Open(session)) {
                let _ = updates.send(Err(error.into()));
                return;
            }
            id
        }
        Ok(Ok(Received::Reattached(id))) => id,
        Ok(Err(status)) => {
            tracing::info!(%status, "open refused");
            let _ = updates.send(Err(status));
            return;
        }
        Err(_) => {
            tracing::warn!(uid = owner.uid, ?timeout, "open dropped: no commit in time");
            let _ = updates.send(Err(Status::deadline_exceeded(format!(
                "the Open stream did not reach `commit` within {timeout:?} of its start \
                 (salusd --open-timeout); the session was dropped and its host memory released"
            ))));
            return;
        }
    };
    // The engine holds the session's update sender from here on: the stream ends when the
    // session is closed.
    drop(updates);
    // The lease holds until the client ends its side or the connection breaks.
    while let Some(Ok(_)) = stream.next().await {}
    end_lease(&engine, &buffers, &servers, owner, id);
}

#[tonic::async_trait]
impl pb::sessions_server::Sessions for Service {
    type OpenStream = BoxStream<pb::SessionUpdate>;

    async fn open(
        &self,
        request: Request<Streaming<pb::OpenRequest>>,
    ) -> Result<Response<Self::OpenStream>, Status> {
        let owner = self.principal(&request)?;
        let (updates, rx) = mpsc::unbounded_channel();
        let lease = Lease {
            engine: self.engine.clone(),
            buffers: self.buffers.clone(),
            servers: self.servers.clone(),
            owner,
            session: None,
            updates: UnboundedReceiverStream::new(rx),
        };
        tokio::spawn(hold_lease(
            self.engine.clone(),
            self.buffers.clone(),
            self.servers.clone(),
            owner,
            request.into_inner(),
            updates,
        ));
        Ok(Response::new(Box::pin(lease)))
    }

    async fn run(
        &self,
        request: Request<pb::RunRequest>,
    ) -> Result<Response<pb::RunResponse>, Status> {
        let principal = self.principal(&request)?;
        let request = request.into_inner();
        let tag = request.tag;
        let result = iterations::submit(&self.engine, &self.buffers, principal, request)
            .await
            .await?;
        Ok(Response::new(run_response(tag, Ok(result))))
    }

    type RunStreamStream = BoxStream<pb::RunResponse>;

    async fn run_stream(
        &self,
        request: Request<Streaming<pb::RunRequest>>,
    ) -> Result<Response<Self::RunStreamStream>, Status> {
        let principal = self.principal(&request)?;
        Ok(Response::new(pipeline::run_stream(
            self.engine.clone(),
            self.buffers.clone(),
            principal,
            request.into_inner(),
        )))
    }

    type ReadTensorsStream = BoxStream<pb::TensorChunk>;

    async fn read_tensors(
        &self,
        request: Request<pb::ReadTensorsRequest>,
    ) -> Result<Response<Self::ReadTensorsStream>, Status> {
        let principal = self.principal(&request)?;
        let pb::ReadTensorsRequest { session, tensors } = request.into_inner();
        let values = self
            .engine
            .ask(|reply| Command::Read {
                principal,
                session,
                tensors,
                reply,
            })
            .await?;
        let chunks = transfer::ReadChunks::new(values).map(Ok);
        Ok(Response::new(Box::pin(tokio_stream::iter(chunks))))
    }

    async fn write_tensors(
        &self,
        request: Request<Streaming<pb::WriteTensorsRequest>>,
    ) -> Result<Response<pb::WriteTensorsResponse>, Status> {
        let principal = self.principal(&request)?;
        let mut stream = request.into_inner();
        let session = match stream.next().await {
            Some(Ok(pb::WriteTensorsRequest {
                item: Some(pb::write_tensors_request::Item::Session(id)),
            })) => id,
            Some(Err(status)) => return Err(bounded(status)),
            _ => {
                return Err(Status::invalid_argument(
                    "the first WriteTensors message must name the session",
                ));
            }
        };
        // The session and the caller's right to it are checked before any bytes are kept;
        // its program bounds what the write may hold.
        let program = self
            .engine
            .ask(|reply| Command::Programs {
                principal,
                session,
                reply,
            })
            .await?
            .swap_remove(0);
        let mut assembly = transfer::WriteAssembly::new(program);
        while let Some(message) = stream.next().await {
            let Some(pb::write_tensors_request::Item::Chunk(chunk)) =
                message.map_err(bounded)?.item
            else {
                return Err(Status::invalid_argument(
                    "after the session, WriteTensors takes only chunks",
                ));
            };
            assembly.add(chunk).map_err(bounded)?;
        }
        let written = self
            .engine
            .ask(|reply| Command::Write {
                principal,
                session,
                tensors: assembly.finish(),
                reply,
            })
            .await?;
        Ok(Response::new(pb::WriteTensorsResponse {
            tensors_written: written,
        }))
    }

    async fn close(
        &self,
        request: Request<pb::CloseRequest>,
    ) -> Result<Response<pb::CloseResponse>, Status> {
        let principal = self.principal(&request)?;
        let session = request.into_inner().session;
        self.engine
            .ask(|reply| Command::Close {
                principal,
                session,
                reply: Some(reply),
            })
            .await?;
        self.servers.stop(session);
        Ok(Response::new(pb::CloseResponse {}))
    }

    async fn add_program(
        &self,
        request: Request<pb::AddProgramRequest>,
    ) -> Result<Response<pb::AddProgramResponse>, Status> {
        let principal = self.principal(&request)?;
        let pb::AddProgramRequest { session, graph } = request.into_inner();
        let graph = graph.ok_or_else(|| Status::invalid_argument("AddProgram has no graph"))?;
        let graph = salus_graph::Graph::from_proto(&graph)
            .map_err(|e| Status::invalid_argument(format!("graph rejected: {e}")))?;
        // Planning a large graph takes a while: off the async workers.
        let engine = self.engine.clone();
        let program = tokio::task::spawn_blocking(move || engine.plan(graph))
            .await
            .map_err(|e| Status::internal(format!("planning stopped: {e}")))?
            .map_err(|e| Status::invalid_argument(format!("graph rejected: {e}")))?;
        let ephemeral_bytes = program.plan().ephemeral_bytes;
        let number = self
            .engine
            .ask(|reply| Command::AddProgram {
                principal,
                session,
                program: Box::new(program),
                reply,
            })
            .await?;
        Ok(Response::new(pb::AddProgramResponse {
            program: number,
            ephemeral_bytes,
        }))
    }

    async fn attach_buffer(
        &self,
        request: Request<pb::AttachBufferRequest>,
    ) -> Result<Response<pb::AttachBufferResponse>, Status> {
        let principal = self.principal(&request)?;
        if !matches!(
            salus_proto::wire::peer(&request),
            salus_proto::wire::Peer::Unix { .. }
        ) {
            return Err(Status::failed_precondition(
                "feed buffers are for clients on salusd's Unix socket (same host, known uid)",
            ));
        }
        let pb::AttachBufferRequest { session, path } = request.into_inner();
        self.engine
            .ask(|reply| Command::Owns {
                principal,
                session,
                reply,
            })
            .await?;
        let buffer = FeedBuffer::open(&path, principal)?;
        let size = buffer.size();
        self.buffers.attach(session, buffer);
        Ok(Response::new(pb::AttachBufferResponse { size }))
    }

    async fn serve(
        &self,
        request: Request<pb::ServeRequest>,
    ) -> Result<Response<pb::ServeResponse>, Status> {
        let principal = self.principal(&request)?;
        serve::serve(&self.engine, &self.servers, principal, request.into_inner())
            .await
            .map(Response::new)
    }

    async fn infer(
        &self,
        request: Request<pb::InferRequest>,
    ) -> Result<Response<pb::InferResponse>, Status> {
        let arrived = std::time::Instant::now();
        let principal = self.principal(&request)?;
        serve::infer(&self.servers, principal, request.into_inner(), arrived)
            .await
            .map(Response::new)
    }
}

#[tonic::async_trait]
impl pb::admin_server::Admin for Service {
    async fn status(
        &self,
        request: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::StatusResponse>, Status> {
        self.principal(&request)?;
        let report = self.engine.ask(Command::Status).await?;
        Ok(Response::new(convert::status(report)))
    }

    async fn list_sessions(
        &self,
        request: Request<pb::ListSessionsRequest>,
    ) -> Result<Response<pb::ListSessionsResponse>, Status> {
        self.principal(&request)?;
        let serving = self.servers.stats();
        let sessions = self
            .engine
            .ask(Command::Sessions)
            .await?
            .into_iter()
            .map(|report| {
                let stats = serving.get(&report.id.0);
                let mut info = convert::session_info(report);
                info.serving = stats.map(convert::serving_info);
                info
            })
            .collect();
        Ok(Response::new(pb::ListSessionsResponse { sessions }))
    }

    async fn set_policy(
        &self,
        request: Request<pb::SetPolicyRequest>,
    ) -> Result<Response<pb::SetPolicyResponse>, Status> {
        let principal = self.principal(&request)?;
        let name = request.into_inner().policy;
        let policy = if name.is_empty() {
            None
        } else {
            Some(
                name.parse::<PolicyKind>()
                    .map_err(|e| Status::invalid_argument(bounded_message(&e)))?,
            )
        };
        let policy = self
            .engine
            .ask(|reply| Command::Policy {
                principal,
                policy,
                reply,
            })
            .await?;
        Ok(Response::new(pb::SetPolicyResponse {
            policy: policy.to_string(),
        }))
    }

    async fn set_offline(
        &self,
        request: Request<pb::SetOfflineRequest>,
    ) -> Result<Response<pb::SetOfflineResponse>, Status> {
        let principal = self.principal(&request)?;
        let enable = request.into_inner().enable;
        let health = self
            .engine
            .ask(|reply| Command::Offline {
                principal,
                enable,
                reply,
            })
            .await?;
        Ok(Response::new(pb::SetOfflineResponse {
            health: health.to_string(),
        }))
    }

    async fn drain(
        &self,
        request: Request<pb::DrainRequest>,
    ) -> Result<Response<pb::DrainResponse>, Status> {
        let principal = self.principal(&request)?;
        let drain = request.into_inner().drain;
        let draining = self
            .engine
            .ask(|reply| Command::Drain {
                principal,
                drain,
                reply,
            })
            .await?;
        Ok(Response::new(pb::DrainResponse { draining }))
    }

    type WatchStream = BoxStream<pb::Event>;

    async fn watch(
        &self,
        request: Request<pb::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        self.principal(&request)?;
        let mut events = self.engine.subscribe();
        let mut stopping = self.engine.stopping();
        let (tx, rx) = mpsc::unbounded_channel();
        let failed = tx.clone();
        // Forward events until the client goes or the daemon stops.
        let forwarding = tokio::spawn(async move {
            loop {
                let event = tokio::select! {
                    event = events.recv() => event,
                    _ = stopping.wait_for(|&s| s) => break,
                };
                let event = match event {
                    Ok(event) => convert::event(event),
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => pb::Event {
                        detail: format!("{n} events were dropped: this watcher fell behind"),
                        ..Default::default()
                    },
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => break,
                };
                if tx.send(Ok(event)).is_err() {
                    break;
                }
            }
        });
        tokio::spawn(async move {
            if let Err(error) = forwarding.await
                && let Some(status) = panicked(error)
            {
                let _ = failed.send(Err(status));
            }
        });
        Ok(Response::new(Box::pin(UnboundedReceiverStream::new(rx))))
    }
}
