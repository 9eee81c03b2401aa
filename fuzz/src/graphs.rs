//! The path a session's graph takes in salusd, `open` and `AddProgram` alike: decode the
//! `salus.v1.Graph`, convert it ([`Graph::from_proto`]), validate and plan it
//! ([`Program::new`] with the default limits, as on the cpu and sim devices), and cost it
//! ([`CostModel::iteration`], what the sim device waits per iteration).
//!
//! Beyond "no panic", a graph that passes must come back the same through protobuf, and
//! its memory plan must hold what the executors rely on: every tensor inside its block,
//! no two persistent tensors overlapping, no two lane buffers overlapping while both are
//! live, E at least the lower bound.

use prost::Message;
use salus_exec::{CostModel, Program};
use salus_graph::{Graph, Limits, MemoryPlan};
use salus_proto::v1 as pb;

/// Plans with more lane buffers than this skip the pairwise overlap check (quadratic).
const OVERLAP_CHECK_MAX_BUFFERS: usize = 2048;

/// Decodes `bytes` as a `salus.v1.Graph` and takes it down salusd's graph path.
pub fn check_message(bytes: &[u8]) {
    if let Ok(message) = pb::Graph::decode(bytes) {
        check_proto(&message);
    }
}

/// Converts `message` and takes it down salusd's graph path; the program when it passes.
pub fn check_proto(message: &pb::Graph) -> Option<Program> {
    let graph = Graph::from_proto(message).ok()?;
    let again = Graph::from_proto(&graph.to_proto()).expect("a converted graph converts back");
    // Debug as the fallback compares NaN attributes as equal.
    if graph != again {
        assert_eq!(
            format!("{graph:?}"),
            format!("{again:?}"),
            "the protobuf round trip changed the graph"
        );
    }
    check(graph)
}

/// Validates and plans `graph` as salusd does; checks the plan; the program when it passes.
pub fn check(graph: Graph) -> Option<Program> {
    let program = Program::new(graph, &Limits::default()).ok()?;
    check_plan(&program);
    let _ = CostModel::default().iteration(&program);
    Some(program)
}

/// The memory plan's invariants.
pub fn check_plan(program: &Program) {
    let plan: &MemoryPlan = program.plan();
    let graph = program.graph();
    let (p, e) = (plan.persistent_bytes, plan.ephemeral_bytes);
    assert_eq!(plan.persistent_offsets.len(), graph.tensors.len());
    assert_eq!(plan.buffer_of.len(), graph.tensors.len());
    assert!(
        plan.lower_bound <= e,
        "E {e} is below the lower bound {}",
        plan.lower_bound
    );
    let mut persistent = Vec::new();
    for (id, tensor) in graph.tensors.iter().enumerate() {
        let bytes = tensor
            .ty
            .bytes()
            .expect("a validated tensor has a size in bytes");
        if let Some(offset) = plan.persistent_offsets[id] {
            let end = offset.checked_add(bytes).expect("persistent end overflows");
            assert!(end <= p, "tensor {id} ends at {end}, past P {p}");
            if bytes > 0 {
                persistent.push((offset, end, id));
            }
        }
        if let Some(buffer) = plan.buffer_of[id] {
            let b = &plan.buffers[buffer];
            assert!(
                bytes <= b.size,
                "tensor {id} ({bytes} bytes) in buffer {buffer} of {} bytes",
                b.size
            );
        }
    }
    persistent.sort_unstable();
    for pair in persistent.windows(2) {
        assert!(
            pair[0].1 <= pair[1].0,
            "persistent tensors {} and {} overlap",
            pair[0].2,
            pair[1].2
        );
    }
    for (i, b) in plan.buffers.iter().enumerate() {
        let end = b.offset.checked_add(b.size).expect("buffer end overflows");
        assert!(end <= e, "buffer {i} ends at {end}, past E {e}");
        assert!(b.first <= b.last, "buffer {i} dies before it is born");
    }
    if plan.buffers.len() <= OVERLAP_CHECK_MAX_BUFFERS {
        for (i, a) in plan.buffers.iter().enumerate() {
            for (j, b) in plan.buffers.iter().enumerate().skip(i + 1) {
                let live_together = a.first <= b.last && b.first <= a.last;
                let disjoint = a.offset + a.size <= b.offset || b.offset + b.size <= a.offset;
                assert!(
                    !live_together || disjoint || a.size == 0 || b.size == 0,
                    "lane buffers {i} {a:?} and {j} {b:?} overlap while both are live"
                );
            }
        }
    }
}
