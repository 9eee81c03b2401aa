//! The gRPC services: requests in, engine commands out.
//!
//! This layer is the protocol edge, and the only one that speaks protobuf and gRPC
//! statuses. It authenticates every request, decodes and validates what clients send
//! (graphs, chunks, feeds; `open`) so the engine only ever sees well-formed work, and
//! turns the engine's domain answers and errors into messages and statuses (`convert`).

mod buffers;
mod convert;
mod iterations;
mod open;

use std::pin::Pin;

use salus_core::PolicyKind;
use salus_proto::{v1 as pb, wire};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

use crate::auth::{Access, Principal};
use crate::engine::{Command, Engine};
use buffers::{Buffers, FeedBuffer};
use convert::run_response;
pub use convert::{code, micros};

/// Iterations one `RunStream` may have submitted and not yet answered.
pub const PIPELINE: usize = 16;

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

/// Both services share the engine handle and the access rules.
#[derive(Clone)]
pub struct Service {
    engine: Engine,
    access: Access,
    buffers: Buffers,
}

impl Service {
    /// Services answering from `engine`, authenticating with `access`.
    pub fn new(engine: Engine, access: Access) -> Service {
        Service {
            engine,
            access,
            buffers: Buffers::default(),
        }
    }

    fn principal<T>(&self, request: &Request<T>) -> Result<Principal, Status> {
        self.access.principal(request)
    }
}

/// Ends a session's lease when its update stream is dropped (the client went away).
struct Lease {
    engine: Engine,
    buffers: Buffers,
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
        next
    }
}

fn end_lease(engine: &Engine, buffers: &Buffers, owner: Principal, session: u64) {
    buffers.detach(session);
    let _ = engine.send(Command::Close {
        principal: owner,
        session,
        reply: None,
    });
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(session) = self.session {
            end_lease(&self.engine, &self.buffers, self.owner, session);
        }
    }
}

#[tonic::async_trait]
impl pb::sessions_server::Sessions for Service {
    type OpenStream = BoxStream<pb::SessionUpdate>;

    async fn open(
        &self,
        request: Request<Streaming<pb::OpenRequest>>,
    ) -> Result<Response<Self::OpenStream>, Status> {
        let owner = self.principal(&request)?;
        let mut stream = request.into_inner();
        let (updates, rx) = mpsc::unbounded_channel();
        let engine = self.engine.clone();
        let buffers = self.buffers.clone();
        let lease = Lease {
            engine: engine.clone(),
            buffers: buffers.clone(),
            owner,
            session: None,
            updates: UnboundedReceiverStream::new(rx),
        };
        tokio::spawn(async move {
            let id = match open::receive_session(&engine, owner, &mut stream, updates.clone()).await
            {
                Ok(session) => {
                    let id = session.id;
                    if engine.send(Command::Open(Box::new(session))).is_err() {
                        return;
                    }
                    id
                }
                Err(status) => {
                    tracing::info!(%status, "open refused");
                    let _ = updates.send(Err(status));
                    return;
                }
            };
            // The engine holds the session's update sender from here on: the stream ends
            // when the session is closed.
            drop(updates);
            // The lease holds until the client ends its side or the connection breaks.
            while let Some(Ok(_)) = stream.next().await {}
            end_lease(&engine, &buffers, owner, id);
        });
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
        let mut requests = request.into_inner();
        let engine = self.engine.clone();
        let buffers = self.buffers.clone();
        let (tx, rx) = mpsc::unbounded_channel();
        // At most PIPELINE iterations of one stream wait at a time: past that, the daemon
        // stops reading the stream and HTTP/2 flow control holds the client back.
        let (order_tx, mut order_rx) = mpsc::channel(PIPELINE);
        // Submit as requests arrive; answer in request order.
        tokio::spawn(async move {
            while let Some(request) = requests.next().await {
                let Ok(request) = request else { break };
                let tag = request.tag;
                let answer = iterations::submit(&engine, &buffers, principal, request).await;
                if order_tx.send((tag, answer)).await.is_err() {
                    break;
                }
            }
        });
        tokio::spawn(async move {
            while let Some((tag, answer)) = order_rx.recv().await {
                let result = answer.await;
                if tx.send(Ok(run_response(tag, result))).is_err() {
                    break;
                }
            }
        });
        Ok(Response::new(Box::pin(UnboundedReceiverStream::new(rx))))
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
        let chunks = values
            .into_iter()
            .flat_map(|(id, bytes)| wire::chunks(id, &bytes))
            .map(Ok);
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
            Some(Err(status)) => return Err(status),
            _ => {
                return Err(Status::invalid_argument(
                    "the first WriteTensors message must name the session",
                ));
            }
        };
        let mut tensors: Vec<(u32, Vec<u8>)> = Vec::new();
        while let Some(message) = stream.next().await {
            let Some(pb::write_tensors_request::Item::Chunk(chunk)) = message?.item else {
                return Err(Status::invalid_argument(
                    "after the session, WriteTensors takes only chunks",
                ));
            };
            match tensors.last_mut() {
                Some((id, bytes)) if *id == chunk.tensor && chunk.offset > 0 => {
                    if chunk.offset != bytes.len() as u64 {
                        return Err(Status::invalid_argument(format!(
                            "tensor {}: chunk at byte {} after {} bytes (chunks go in order)",
                            chunk.tensor,
                            chunk.offset,
                            bytes.len()
                        )));
                    }
                    bytes.extend_from_slice(&chunk.data);
                }
                _ if chunk.offset == 0 => tensors.push((chunk.tensor, chunk.data)),
                _ => {
                    return Err(Status::invalid_argument(format!(
                        "tensor {}: first chunk at byte {} (chunks go in order)",
                        chunk.tensor, chunk.offset
                    )));
                }
            }
        }
        let written = self
            .engine
            .ask(|reply| Command::Write {
                principal,
                session,
                tensors,
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
        if !matches!(wire::peer(&request), wire::Peer::Unix { .. }) {
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
        let sessions = self
            .engine
            .ask(Command::Sessions)
            .await?
            .into_iter()
            .map(convert::session_info)
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
                    .map_err(Status::invalid_argument)?,
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
        // Forward events until the client goes or the daemon stops.
        tokio::spawn(async move {
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
        Ok(Response::new(Box::pin(UnboundedReceiverStream::new(rx))))
    }
}
