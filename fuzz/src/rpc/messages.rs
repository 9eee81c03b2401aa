//! Encoding a script's requests: specs plus what the script knows (its sessions, their
//! graphs) in, protobuf bytes out.

use std::sync::OnceLock;

use prost::Message;
use salus_graph::{DType, Graph, Role};
use salus_proto::v1 as pb;

use super::{
    ChunkSpec, Extra, Feeds, GraphChoice, Initial, Length, NameSpec, Offset, OpenSpec, Patch,
    RunSpec, TensorRef,
};

/// The longest patch appended to a message.
const PATCH_BYTES: usize = 64;

/// What requests need to know of a graph.
#[derive(Debug, Clone, Default)]
pub struct GraphInfo {
    /// The graph as sent.
    pub proto: pb::Graph,
    /// PARAMETER and STATE tensors, in graph order: (id, dtype, bytes).
    pub persistent: Vec<(u32, DType, u64)>,
    /// FEED tensors, in graph order: (dtype, bytes).
    pub feeds: Vec<(DType, u64)>,
}

fn mlp() -> &'static pb::Graph {
    static MLP: OnceLock<pb::Graph> = OnceLock::new();
    MLP.get_or_init(|| {
        pb::Graph::decode(&include_bytes!("../../seeds/graph/mlp.pb")[..])
            .expect("the seed graph decodes")
    })
}

impl GraphInfo {
    pub fn of(choice: &GraphChoice) -> GraphInfo {
        let graph = match choice {
            GraphChoice::Relu => relu(),
            GraphChoice::Regression { n, d, k } => salus_graph::samples::regression(
                1 + u64::from(n % 8),
                1 + u64::from(d % 6),
                1 + u64::from(k % 3),
                0.1,
            ),
            GraphChoice::Embedding => salus_graph::samples::embedding_sum(),
            GraphChoice::Mlp => return GraphInfo::from_proto(mlp().clone()),
            GraphChoice::Bytes(bytes) => {
                return GraphInfo::from_proto(pb::Graph::decode(&bytes[..]).unwrap_or_default());
            }
        };
        GraphInfo::from_graph(graph.to_proto(), &graph)
    }

    fn from_proto(proto: pb::Graph) -> GraphInfo {
        match Graph::from_proto(&proto) {
            Ok(graph) => GraphInfo::from_graph(proto, &graph),
            Err(_) => GraphInfo {
                proto,
                ..Default::default()
            },
        }
    }

    fn from_graph(proto: pb::Graph, graph: &Graph) -> GraphInfo {
        let bytes = |t: &salus_graph::Tensor| t.ty.bytes().unwrap_or(0);
        GraphInfo {
            persistent: graph
                .tensors
                .iter()
                .enumerate()
                .filter(|(_, t)| matches!(t.role, Role::Parameter | Role::State))
                .map(|(id, t)| (id as u32, t.ty.dtype, bytes(t)))
                .collect(),
            feeds: graph
                .tensors
                .iter()
                .filter(|t| t.role == Role::Feed)
                .map(|t| (t.ty.dtype, bytes(t)))
                .collect(),
            proto,
        }
    }

    /// The tensor a reference names, with its dtype and size when it is persistent.
    fn tensor(&self, tensor: TensorRef) -> (u32, Option<(DType, u64)>) {
        match tensor {
            TensorRef::Persistent(i) if !self.persistent.is_empty() => {
                let (id, dtype, bytes) = self.persistent[i as usize % self.persistent.len()];
                (id, Some((dtype, bytes)))
            }
            TensorRef::Persistent(i) => (u32::from(i), None),
            TensorRef::Any(id) => (
                id,
                self.persistent
                    .iter()
                    .find(|p| p.0 == id)
                    .map(|&(_, dtype, bytes)| (dtype, bytes)),
            ),
        }
    }

    /// A chunk as the spec describes it, of this graph's tensors.
    pub fn chunk(&self, spec: &ChunkSpec) -> pb::TensorChunk {
        let (tensor, known) = self.tensor(spec.tensor);
        let (dtype, bytes) = known.unwrap_or((DType::F32, 0));
        let offset = match spec.offset {
            Offset::Zero => 0,
            Offset::Half => bytes / 2,
            Offset::Any(o) => o,
        };
        let length = match spec.length {
            Length::Rest => bytes.saturating_sub(offset),
            Length::Any(n) => u64::from(n),
        };
        pb::TensorChunk {
            tensor,
            offset,
            data: values(dtype, length.min(1 << 16), spec.fill),
        }
    }

    /// Every persistent tensor, whole, in the chunks a client sends.
    pub fn initial(&self, seed: u8) -> Vec<pb::TensorChunk> {
        self.persistent
            .iter()
            .flat_map(|&(id, dtype, bytes)| {
                salus_proto::wire::chunks(id, &values(dtype, bytes, seed.wrapping_add(id as u8)))
            })
            .collect()
    }
}

/// relu of a 4-element feed.
fn relu() -> Graph {
    let t = |name: &str, role| salus_graph::Tensor {
        name: name.into(),
        ty: salus_graph::TensorType::new(DType::F32, vec![4]),
        role,
        data: vec![],
    };
    Graph {
        tensors: vec![t("x", Role::Feed), t("y", Role::Intermediate)],
        nodes: vec![salus_graph::Node {
            name: "relu".into(),
            op: salus_graph::Op::Relu,
            inputs: vec![Some(0)],
            outputs: vec![Some(1)],
            attrs: Default::default(),
            source: String::new(),
        }],
        fetches: vec![1],
        updates: vec![],
        precision: Default::default(),
    }
}

/// `bytes` bytes of values of `dtype` from `seed`: small floats, integers from 0 to 4 (the
/// embedding sample's ids, out of range now and then).
pub fn values(dtype: DType, bytes: u64, seed: u8) -> Vec<u8> {
    let mut state = u64::from(seed).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let size = dtype.size().max(1);
    let mut out = Vec::with_capacity(bytes as usize);
    while (out.len() as u64) < bytes {
        let r = next();
        match dtype {
            DType::F32 => out.extend_from_slice(&((r % 2000) as f32 / 1000.0 - 1.0).to_le_bytes()),
            DType::I64 => out.extend_from_slice(&((r % 5) as i64).to_le_bytes()),
            DType::I32 => out.extend_from_slice(&((r % 5) as i32).to_le_bytes()),
            DType::Bool => out.push((r % 2) as u8),
            _ => out.extend_from_slice(&(r as u16 & 0x3fff).to_le_bytes()[..size as usize]),
        }
    }
    out.truncate(bytes as usize);
    out
}

/// `message`'s encoding with the patch after it.
pub fn encode(message: &impl Message, patch: &Patch) -> Vec<u8> {
    let mut bytes = message.encode_to_vec();
    bytes.extend_from_slice(&patch.0[..patch.0.len().min(PATCH_BYTES)]);
    bytes
}

fn open_request(item: pb::open_request::Item) -> pb::OpenRequest {
    pb::OpenRequest { item: Some(item) }
}

/// The messages of an `Open` stream, `open` first.
pub fn open_stream(spec: &OpenSpec, info: &GraphInfo) -> Vec<Vec<u8>> {
    use pb::open_request::Item;
    let name = match &spec.name {
        NameSpec::Short => "fuzz".to_string(),
        NameSpec::Long(n) => "n".repeat(usize::from(n % 512)),
        NameSpec::Any(s) => s.clone(),
    };
    let open = pb::OpenSession {
        graph: Some(info.proto.clone()),
        kind: spec.kind,
        hints: Some(pb::Hints {
            name,
            priority: spec.priority,
            total_iterations: spec.total_iterations,
            expected_iteration_ms: spec.expected_iteration_ms,
            class: if spec.class.rem_euclid(8) < 7 {
                spec.class.rem_euclid(2)
            } else {
                spec.class
            },
            slo_ms: spec.slo_ms,
        }),
    };
    let mut messages = vec![encode(&open_request(Item::Open(open)), &spec.patch)];
    let chunks = match &spec.initial {
        Initial::Exact(seed) => info.initial(*seed),
        Initial::Chunks(chunks) => chunks.iter().take(8).map(|c| info.chunk(c)).collect(),
    };
    messages.extend(
        chunks
            .into_iter()
            .map(|c| open_request(Item::Chunk(c)).encode_to_vec()),
    );
    for extra in spec.extra.iter().take(4) {
        messages.push(match extra {
            Extra::Chunk(c) => open_request(Item::Chunk(info.chunk(c))).encode_to_vec(),
            Extra::Open => open_request(Item::Open(pb::OpenSession::default())).encode_to_vec(),
            Extra::Reattach => {
                open_request(Item::Reattach(pb::Reattach::default())).encode_to_vec()
            }
            Extra::Empty => pb::OpenRequest::default().encode_to_vec(),
            Extra::Raw(bytes) => bytes.clone(),
        });
    }
    if spec.commit {
        messages.push(open_request(Item::Commit(pb::Commit {})).encode_to_vec());
    }
    messages
}

/// A `RunRequest` for `session`, whose programs are `programs` (empty when unknown).
pub fn run_request(
    spec: &RunSpec,
    session: u64,
    programs: &[GraphInfo],
    info: &GraphInfo,
) -> Vec<u8> {
    // Mostly a program the session has.
    let number = spec.program % 4;
    let program = programs.get(usize::from(number)).or(programs.first());
    let feeds = match &spec.feeds {
        Feeds::Exact(seed) => program.map_or_else(Vec::new, |p| {
            p.feeds
                .iter()
                .enumerate()
                .map(|(i, &(dtype, bytes))| values(dtype, bytes, seed.wrapping_add(i as u8)))
                .collect()
        }),
        Feeds::Sized(sizes) => sizes
            .iter()
            .take(8)
            .map(|&n| vec![0x3c; usize::from(n)])
            .collect(),
        Feeds::Any(feeds) => feeds.iter().take(8).cloned().collect(),
    };
    let range = |(offset, length): (u64, u64)| pb::BufferRange { offset, length };
    let request = pb::RunRequest {
        session,
        feeds,
        tag: spec.tag,
        writes: spec.writes.iter().take(4).map(|c| info.chunk(c)).collect(),
        program: u32::from(number),
        feed_ranges: spec.ranges.map(range).into_iter().collect(),
        fetch_ranges: spec.ranges.map(range).into_iter().collect(),
    };
    encode(&request, &spec.patch)
}
