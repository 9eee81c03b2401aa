//! Tensor transfers between iterations: `ReadTensors` chunks made as the client takes
//! them, and `WriteTensors` chunks checked against the session's program as they arrive.

use std::collections::HashSet;
use std::sync::Arc;

use salus_exec::Program;
use salus_proto::{v1 as pb, wire};
use tonic::Status;

use crate::engine::{EngineError, persistent_range};

/// The chunks of a read, cut from the tensors' bytes one at a time as the stream is
/// polled: nothing is copied ahead, and each tensor's bytes are freed once its last chunk
/// is out.
pub(super) struct ReadChunks {
    tensors: std::vec::IntoIter<(u32, Vec<u8>)>,
    /// The tensor being sent and how many of its bytes are out.
    current: Option<(u32, Vec<u8>, usize)>,
}

impl ReadChunks {
    /// The chunks of `tensors`, in order, each tensor's in offset order.
    pub(super) fn new(tensors: Vec<(u32, Vec<u8>)>) -> ReadChunks {
        ReadChunks {
            tensors: tensors.into_iter(),
            current: None,
        }
    }
}

impl Iterator for ReadChunks {
    type Item = pb::TensorChunk;

    fn next(&mut self) -> Option<pb::TensorChunk> {
        let (tensor, bytes, sent) = match self.current.take() {
            Some(current) => current,
            None => {
                let (tensor, bytes) = self.tensors.next()?;
                (tensor, bytes, 0)
            }
        };
        let end = (sent + wire::CHUNK_BYTES).min(bytes.len());
        let chunk = pb::TensorChunk {
            tensor,
            offset: sent as u64,
            data: bytes[sent..end].to_vec(),
        };
        if end < bytes.len() {
            self.current = Some((tensor, bytes, end));
        }
        Some(chunk)
    }
}

/// A write's tensors, assembled from chunks checked as they arrive: each names a persistent
/// tensor of the session, each tensor comes once and in order, and none grows past its
/// size. So a write holds at most the session's P bytes.
pub(super) struct WriteAssembly {
    program: Arc<Program>,
    tensors: Vec<(u32, Vec<u8>)>,
    /// The size of the tensor being assembled (the last of `tensors`).
    size: u64,
    seen: HashSet<u32>,
}

impl WriteAssembly {
    /// An empty write to a session running `program`.
    pub(super) fn new(program: Arc<Program>) -> WriteAssembly {
        WriteAssembly {
            program,
            tensors: Vec::new(),
            size: 0,
            seen: HashSet::new(),
        }
    }

    /// Takes one chunk.
    pub(super) fn add(&mut self, chunk: pb::TensorChunk) -> Result<(), Status> {
        match self.tensors.last_mut() {
            Some((id, bytes)) if *id == chunk.tensor && chunk.offset > 0 => {
                if chunk.offset != bytes.len() as u64 {
                    return Err(Status::invalid_argument(format!(
                        "tensor {}: chunk at byte {} after {} bytes (chunks go in order)",
                        chunk.tensor,
                        chunk.offset,
                        bytes.len()
                    )));
                }
                let end = bytes.len() as u64 + chunk.data.len() as u64;
                check_size(&self.program, chunk.tensor, self.size, end)?;
                bytes.extend_from_slice(&chunk.data);
            }
            _ if chunk.offset == 0 => {
                let (_, size) = persistent_range(&self.program, chunk.tensor)?;
                if !self.seen.insert(chunk.tensor) {
                    return Err(EngineError::DuplicateTensor {
                        request: "WriteTensors",
                        tensor: chunk.tensor,
                    }
                    .into());
                }
                self.size = size;
                check_size(&self.program, chunk.tensor, size, chunk.data.len() as u64)?;
                self.tensors.push((chunk.tensor, chunk.data));
            }
            _ => {
                return Err(Status::invalid_argument(format!(
                    "tensor {}: first chunk at byte {} (chunks go in order)",
                    chunk.tensor, chunk.offset
                )));
            }
        }
        Ok(())
    }

    /// The assembled tensors, (id, bytes) each.
    pub(super) fn finish(self) -> Vec<(u32, Vec<u8>)> {
        self.tensors
    }
}

/// Refuses chunks that give `tensor` (of `size` bytes) more than `end` bytes.
fn check_size(program: &Program, tensor: u32, size: u64, end: u64) -> Result<(), Status> {
    if end <= size {
        return Ok(());
    }
    let t = &program.graph().tensors[tensor as usize];
    Err(Status::invalid_argument(format!(
        "tensor {tensor} '{}' ({}) has {size} bytes; chunks give {end}",
        t.name, t.ty
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_chunks_cover_each_tensor_in_order() {
        let big = vec![7u8; wire::CHUNK_BYTES * 2 + 5];
        let chunks: Vec<pb::TensorChunk> =
            ReadChunks::new(vec![(3, big.clone()), (1, Vec::new()), (2, vec![1, 2])]).collect();
        let summary: Vec<(u32, u64, usize)> = chunks
            .iter()
            .map(|c| (c.tensor, c.offset, c.data.len()))
            .collect();
        let chunk = wire::CHUNK_BYTES;
        assert_eq!(
            summary,
            [
                (3, 0, chunk),
                (3, chunk as u64, chunk),
                (3, 2 * chunk as u64, 5),
                (1, 0, 0),
                (2, 0, 2)
            ]
        );
        assert_eq!(
            chunks.iter().map(|c| c.data.clone()).collect::<Vec<_>>(),
            wire::chunks(3, &big)
                .into_iter()
                .chain(wire::chunks(1, &[]))
                .chain(wire::chunks(2, &[1, 2]))
                .map(|c| c.data)
                .collect::<Vec<_>>()
        );
    }
}
