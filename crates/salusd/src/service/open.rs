//! Receiving a session: the `Open` stream's graph, hints and initial tensor values,
//! checked and assembled into the host image the engine takes.

use std::collections::HashMap;

use salus_core::{Hints, SessionClass};
use salus_exec::{Location, Program};
use salus_graph::{Graph, GraphError, Role};
use salus_proto::v1 as pb;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tonic::{Status, Streaming};

use super::convert::{bounded, bounded_message, session_kind, update_sink};
use crate::auth::Principal;
use crate::engine::{Engine, HostImage, NewSession};

fn graph_status(e: &GraphError) -> Status {
    Status::invalid_argument(bounded_message(&format!("graph rejected: {e}")))
}

/// The longest iteration a client may announce in `hints.expected_iteration_ms`: a day.
/// Longer is a mistake, and a duration past what `Duration` holds would not convert.
pub const MAX_EXPECTED_ITERATION_MS: f64 = 86_400_000.0;

/// Rejects, before any tensor bytes are held, a session that can never fit.
fn check_fits(engine: &Engine, p: u64, e: u64, class: SessionClass) -> Result<(), Status> {
    let memory = engine.memory();
    let aligned = |b: u64| memory.align_up(b).unwrap_or(u64::MAX);
    let need = aligned(p).saturating_add(aligned(e.max(1)));
    let protection = engine.protection();
    let limit = protection.offline_limit(memory.usable());
    if class == SessionClass::Offline && protection.enabled && need > limit {
        return Err(Status::resource_exhausted(format!(
            "the offline session needs {need} bytes (P {p} + E {e}, aligned) but offline \
             sessions may hold at most {limit} bytes together (--offline-share {}); it can \
             never run here",
            protection.offline_memory_share
        )));
    }
    if !memory.fits_empty(p, e.max(1)) {
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

/// A session's hints and class from their message, checked.
pub fn hints_from_proto(h: Option<pb::Hints>) -> Result<(Hints, SessionClass), Status> {
    let h = h.unwrap_or_default();
    let class = match pb::SessionClass::try_from(h.class) {
        Ok(pb::SessionClass::Online) => SessionClass::Online,
        Ok(pb::SessionClass::Offline) => SessionClass::Offline,
        Err(_) => {
            return Err(Status::invalid_argument(format!(
                "hints.class {} is not a session class (0 online, 1 offline)",
                h.class
            )));
        }
    };
    let slo = if h.slo_ms == 0.0 {
        None
    } else if (0.0..=MAX_EXPECTED_ITERATION_MS).contains(&h.slo_ms) {
        std::time::Duration::try_from_secs_f64(h.slo_ms / 1e3).ok()
    } else {
        return Err(Status::invalid_argument(format!(
            "hints.slo_ms must be a number from 0 (none) to {MAX_EXPECTED_ITERATION_MS} (a \
             day), got {}",
            h.slo_ms
        )));
    };
    if slo.is_some() && class == SessionClass::Offline {
        return Err(Status::invalid_argument(
            "hints.slo_ms is for online sessions; an offline session has no latency target",
        ));
    }
    let ms = h.expected_iteration_ms;
    let expected_iteration = if (0.0..=MAX_EXPECTED_ITERATION_MS).contains(&ms) {
        std::time::Duration::try_from_secs_f64(ms / 1e3).ok()
    } else {
        None
    };
    let Some(expected_iteration) = expected_iteration else {
        return Err(Status::invalid_argument(format!(
            "hints.expected_iteration_ms must be a number from 0 (unknown) to \
             {MAX_EXPECTED_ITERATION_MS} (a day), got {ms}"
        )));
    };
    if h.name.len() > 256 {
        return Err(Status::invalid_argument(
            "hints.name is longer than 256 bytes",
        ));
    }
    let hints = Hints {
        name: h.name,
        priority: h.priority,
        total_iterations: (h.total_iterations > 0).then_some(h.total_iterations),
        expected_iteration: (!expected_iteration.is_zero()).then_some(expected_iteration),
        slo,
    };
    Ok((hints, class))
}

/// A session's hints and class as their message.
pub fn hints_to_proto(hints: &Hints, class: SessionClass) -> pb::Hints {
    pb::Hints {
        name: hints.name.clone(),
        priority: hints.priority,
        total_iterations: hints.total_iterations.unwrap_or(0),
        expected_iteration_ms: hints
            .expected_iteration
            .map_or(0.0, |d| d.as_secs_f64() * 1e3),
        class: match class {
            SessionClass::Online => pb::SessionClass::Online,
            SessionClass::Offline => pb::SessionClass::Offline,
        } as i32,
        slo_ms: hints.slo.map_or(0.0, |d| d.as_secs_f64() * 1e3),
    }
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

/// Reads the rest of an `Open` stream whose first message was `open`, up to `commit`;
/// returns the session to hand to the engine.
pub(super) async fn receive_session(
    engine: &Engine,
    owner: Principal,
    open: pb::OpenSession,
    stream: &mut Streaming<pb::OpenRequest>,
    updates: mpsc::UnboundedSender<Result<pb::SessionUpdate, Status>>,
) -> Result<NewSession, Status> {
    let graph_message = open
        .graph
        .ok_or_else(|| Status::invalid_argument("`open` has no graph"))?;
    let kind = session_kind(open.kind)?;
    let (hints, class) = hints_from_proto(open.hints)?;
    // Counted from here, while it opens and until it is gone: a user at the limit has
    // nothing planned or held.
    let mut slot = engine.quotas().open_session(owner)?;
    let graph = Graph::from_proto(&graph_message).map_err(|e| graph_status(&e))?;
    let program = engine
        .plan(graph)
        .map_err(|e| graph_status(&e))?
        .with_expected_iteration(hints.expected_iteration);
    let plan = program.plan();
    check_fits(engine, plan.persistent_bytes, plan.ephemeral_bytes, class)?;
    let held = engine.quotas().reserve(owner, plan.persistent_bytes)?;
    slot.uploading(plan.persistent_bytes);
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
            .ok_or_else(|| Status::invalid_argument("the Open stream ended before `commit`"))?
            .map_err(bounded)?;
        match message.item {
            Some(pb::open_request::Item::Chunk(chunk)) => {
                let at = assembly.place(&program, &chunk)?;
                image[at..at + chunk.data.len()].copy_from_slice(&chunk.data);
            }
            Some(pb::open_request::Item::Commit(_)) => break,
            Some(pb::open_request::Item::Open(_) | pb::open_request::Item::Reattach(_)) => {
                return Err(Status::invalid_argument(
                    "`open` or `reattach` after `open`",
                ));
            }
            None => return Err(Status::invalid_argument("an empty Open message")),
        }
    }
    assembly.check_complete(&program)?;
    slot.committed();
    Ok(NewSession {
        id: engine.new_session_id(),
        owner,
        program,
        image: HostImage { bytes: image, held },
        slot,
        kind,
        class,
        hints,
        updates: update_sink(updates),
        token: engine.new_token(),
        restored: None,
    })
}
