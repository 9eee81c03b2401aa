//! The gRPC services: requests in, engine commands out.
//!
//! This layer authenticates every request, decodes and validates what clients send
//! (graphs, chunks, feeds) so the engine only ever sees well-formed work, and turns engine
//! answers into gRPC statuses whose messages say what was wrong.

use std::collections::HashMap;
use std::pin::Pin;

use salus_core::{Hints, PolicyKind};
use salus_exec::{Location, Program};
use salus_graph::{Graph, GraphError, Role};
use salus_proto::v1 as pb;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

use crate::auth::{Access, Principal};
use crate::engine::{Command, Engine, HostImage, NewSession, RunResult, micros, session_kind};

/// Iterations one `RunStream` may have submitted and not yet answered.
pub const PIPELINE: usize = 16;

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

/// Both services share the engine handle and the access rules.
#[derive(Clone)]
pub struct Service {
    engine: Engine,
    access: Access,
}

impl Service {
    /// Services answering from `engine`, authenticating with `access`.
    pub fn new(engine: Engine, access: Access) -> Service {
        Service { engine, access }
    }

    fn principal<T>(&self, request: &Request<T>) -> Result<Principal, Status> {
        self.access.principal(request)
    }
}

fn graph_status(e: &GraphError) -> Status {
    Status::invalid_argument(format!("graph rejected: {e}"))
}

/// Rejects, before any tensor bytes are held, a session that can never fit.
fn check_fits(engine: &Engine, p: u64, e: u64) -> Result<(), Status> {
    let memory = engine.memory();
    if !memory.fits_empty(p, e.max(1)) {
        let aligned = |b: u64| memory.align_up(b).unwrap_or(u64::MAX);
        let need = aligned(p).saturating_add(aligned(e.max(1)));
        return Err(Status::resource_exhausted(format!(
            "the session needs {need} bytes (P {p} + E {e}, aligned) but the device has only {} \
             usable ({} capacity, {} reserved); it can never run here",
            memory.usable(),
            memory.capacity,
            memory.reserve
        )));
    }
    Ok(())
}

fn hints(h: Option<pb::Hints>) -> Result<Hints, Status> {
    let h = h.unwrap_or_default();
    if !h.expected_iteration_ms.is_finite() || h.expected_iteration_ms < 0.0 {
        return Err(Status::invalid_argument(format!(
            "hints.expected_iteration_ms must be a finite number >= 0, got {}",
            h.expected_iteration_ms
        )));
    }
    if h.name.len() > 256 {
        return Err(Status::invalid_argument(
            "hints.name is longer than 256 bytes",
        ));
    }
    Ok(Hints {
        name: h.name,
        priority: h.priority,
        total_iterations: (h.total_iterations > 0).then_some(h.total_iterations),
        expected_iteration: (h.expected_iteration_ms > 0.0)
            .then(|| std::time::Duration::from_secs_f64(h.expected_iteration_ms / 1e3)),
    })
}

/// Assembles a tensor from chunks that must arrive in order.
struct Assembly {
    /// Tensor id to (offset in the image, length, bytes received).
    received: HashMap<u32, (u64, u64, u64)>,
}

impl Assembly {
    fn new() -> Assembly {
        Assembly {
            received: HashMap::new(),
        }
    }

    /// Checks a chunk against the program; returns where its bytes go in the image.
    fn place(&mut self, program: &Program, chunk: &pb::TensorChunk) -> Result<usize, Status> {
        let id = chunk.tensor as usize;
        let tensor = program.graph().tensors.get(id).ok_or_else(|| {
            Status::invalid_argument(format!(
                "chunk for tensor {id}, but the graph has {} tensors",
                program.graph().tensors.len()
            ))
        })?;
        if !matches!(tensor.role, Role::Parameter | Role::State) {
            return Err(Status::invalid_argument(format!(
                "tensor {id} '{}' is {:?}: only PARAMETER and STATE tensors take values",
                tensor.name, tensor.role
            )));
        }
        let Some(Location::Persistent(base)) = program.location(id) else {
            return Err(Status::internal(format!(
                "tensor {id} has no persistent place"
            )));
        };
        let len = program.bytes(id);
        let entry = self.received.entry(chunk.tensor).or_insert((base, len, 0));
        if chunk.offset != entry.2 {
            return Err(Status::invalid_argument(format!(
                "tensor {id} '{}': chunk at byte {} but {} bytes have arrived (chunks go in order)",
                tensor.name, chunk.offset, entry.2
            )));
        }
        let end = entry.2 + chunk.data.len() as u64;
        if end > len {
            return Err(Status::invalid_argument(format!(
                "tensor {id} '{}' ({}) has {len} bytes; chunks give {end}",
                tensor.name, tensor.ty
            )));
        }
        let at = (base + entry.2) as usize;
        entry.2 = end;
        Ok(at)
    }

    /// Every PARAMETER and STATE tensor complete?
    fn check_complete(&self, program: &Program) -> Result<(), Status> {
        for (id, t) in program.graph().tensors.iter().enumerate() {
            if !matches!(t.role, Role::Parameter | Role::State) {
                continue;
            }
            let want = program.bytes(id);
            let got = self.received.get(&(id as u32)).map_or(0, |r| r.2);
            if got != want {
                return Err(Status::invalid_argument(format!(
                    "tensor {id} '{}' ({}) needs {want} bytes of initial value, got {got}",
                    t.name, t.ty
                )));
            }
        }
        Ok(())
    }
}

/// Reads the `Open` stream up to `commit`; returns the session to hand to the engine.
async fn receive_session(
    engine: &Engine,
    owner: Principal,
    stream: &mut Streaming<pb::OpenRequest>,
    updates: mpsc::UnboundedSender<Result<pb::SessionUpdate, Status>>,
) -> Result<NewSession, Status> {
    let first = stream
        .next()
        .await
        .ok_or_else(|| Status::invalid_argument("the Open stream ended before `open`"))??;
    let Some(pb::open_request::Item::Open(open)) = first.item else {
        return Err(Status::invalid_argument(
            "the first Open message must be `open`",
        ));
    };
    let graph_message = open
        .graph
        .ok_or_else(|| Status::invalid_argument("`open` has no graph"))?;
    let kind = session_kind(open.kind)?;
    let hints = hints(open.hints)?;
    let graph = Graph::from_proto(&graph_message).map_err(|e| graph_status(&e))?;
    let program = engine
        .plan(graph)
        .map_err(|e| graph_status(&e))?
        .with_expected_iteration(hints.expected_iteration);
    let plan = program.plan();
    check_fits(engine, plan.persistent_bytes, plan.ephemeral_bytes)?;
    let held = engine.host_budget().reserve(plan.persistent_bytes)?;
    // Zeroed pages are not touched until written: a big image costs what is uploaded.
    let mut image = vec![0u8; plan.persistent_bytes as usize];
    for (id, t) in program.graph().tensors.iter().enumerate() {
        if t.role == Role::Constant
            && let Some(Location::Persistent(off)) = program.location(id)
        {
            let off = off as usize;
            let n = t.data.len().min(image.len().saturating_sub(off));
            image[off..off + n].copy_from_slice(&t.data[..n]);
        }
    }
    let mut assembly = Assembly::new();
    loop {
        let message = stream
            .next()
            .await
            .ok_or_else(|| Status::invalid_argument("the Open stream ended before `commit`"))??;
        match message.item {
            Some(pb::open_request::Item::Chunk(chunk)) => {
                let at = assembly.place(&program, &chunk)?;
                image[at..at + chunk.data.len()].copy_from_slice(&chunk.data);
            }
            Some(pb::open_request::Item::Commit(_)) => break,
            Some(pb::open_request::Item::Open(_)) => {
                return Err(Status::invalid_argument("`open` sent twice"));
            }
            None => return Err(Status::invalid_argument("an empty Open message")),
        }
    }
    assembly.check_complete(&program)?;
    Ok(NewSession {
        id: engine.new_session_id(),
        owner,
        program,
        image: HostImage { bytes: image, held },
        kind,
        hints,
        updates,
    })
}

/// Ends a session's lease when its update stream is dropped (the client went away).
struct Lease {
    engine: Engine,
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

fn end_lease(engine: &Engine, owner: Principal, session: u64) {
    let _ = engine.send(Command::Close {
        principal: owner,
        session,
        reply: None,
    });
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(session) = self.session {
            end_lease(&self.engine, self.owner, session);
        }
    }
}

fn run_response(tag: u64, result: Result<RunResult, Status>) -> pb::RunResponse {
    match result {
        Ok(r) => pb::RunResponse {
            tag,
            fetches: r.fetches,
            device_us: micros(r.device),
            wait_us: micros(r.wait),
            failure: None,
        },
        Err(status) => pb::RunResponse {
            tag,
            failure: Some(pb::Failure {
                code: status.code() as i32,
                message: status.message().to_string(),
            }),
            ..Default::default()
        },
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
        let lease = Lease {
            engine: engine.clone(),
            owner,
            session: None,
            updates: UnboundedReceiverStream::new(rx),
        };
        tokio::spawn(async move {
            let id = match receive_session(&engine, owner, &mut stream, updates.clone()).await {
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
            end_lease(&engine, owner, id);
        });
        Ok(Response::new(Box::pin(lease)))
    }

    async fn run(
        &self,
        request: Request<pb::RunRequest>,
    ) -> Result<Response<pb::RunResponse>, Status> {
        let principal = self.principal(&request)?;
        let pb::RunRequest {
            session,
            feeds,
            tag,
        } = request.into_inner();
        let result = self
            .engine
            .ask(|reply| Command::Run {
                principal,
                session,
                feeds,
                reply,
            })
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
        let (tx, rx) = mpsc::unbounded_channel();
        // At most PIPELINE iterations of one stream wait at a time: past that, the daemon
        // stops reading the stream and HTTP/2 flow control holds the client back.
        let (order_tx, mut order_rx) = mpsc::channel(PIPELINE);
        // Submit as requests arrive; answer in request order.
        tokio::spawn(async move {
            while let Some(request) = requests.next().await {
                let Ok(request) = request else { break };
                let (reply, answer) = tokio::sync::oneshot::channel();
                let sent = engine.send(Command::Run {
                    principal,
                    session: request.session,
                    feeds: request.feeds,
                    reply,
                });
                if sent.is_err() || order_tx.send((request.tag, answer)).await.is_err() {
                    break;
                }
            }
        });
        tokio::spawn(async move {
            while let Some((tag, answer)) = order_rx.recv().await {
                let result = answer
                    .await
                    .unwrap_or_else(|_| Err(Status::unavailable("salusd is shutting down")));
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
            .flat_map(|(id, bytes)| salus_client::chunks(id, &bytes))
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
}

#[tonic::async_trait]
impl pb::admin_server::Admin for Service {
    async fn status(
        &self,
        request: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::StatusResponse>, Status> {
        self.principal(&request)?;
        Ok(Response::new(self.engine.ask(Command::Status).await?))
    }

    async fn list_sessions(
        &self,
        request: Request<pb::ListSessionsRequest>,
    ) -> Result<Response<pb::ListSessionsResponse>, Status> {
        self.principal(&request)?;
        let sessions = self.engine.ask(Command::Sessions).await?;
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
                    Ok(event) => event,
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
