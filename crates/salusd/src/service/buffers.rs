//! Feed buffers: files a client on the Unix socket shares with the daemon, so that an
//! iteration's feeds and fetches travel as ranges of the file instead of message bytes.
//!
//! The daemon opens the client's file once (never following a final symlink, never
//! blocking on a FIFO) and accepts it only if it is a regular file owned by the client's
//! uid with no access for group or others. It reads and writes it with `pread`/`pwrite`,
//! never by mapping it: a client that truncates its file gets short reads (an error for
//! its own iteration), not a fault in the daemon.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::sync::{Arc, Mutex};

use salus_proto::v1 as pb;
use tonic::Status;

use crate::auth::Principal;

/// One session's attached file.
pub struct FeedBuffer {
    /// Who attached it: only they may name ranges of it.
    owner: Principal,
    file: File,
    size: u64,
}

impl FeedBuffer {
    /// Opens and checks the file at `path` for `owner`.
    pub fn open(path: &str, owner: Principal) -> Result<FeedBuffer, Status> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| {
                Status::invalid_argument(format!("cannot open feed buffer {path:?}: {e}"))
            })?;
        let meta = file
            .metadata()
            .map_err(|e| Status::invalid_argument(format!("feed buffer {path:?}: {e}")))?;
        if !meta.file_type().is_file() {
            return Err(Status::invalid_argument(format!(
                "feed buffer {path:?} is not a regular file"
            )));
        }
        if meta.uid() != owner.uid {
            return Err(Status::permission_denied(format!(
                "feed buffer {path:?} belongs to uid {}, not to {owner}",
                meta.uid()
            )));
        }
        if meta.mode() & 0o077 != 0 {
            return Err(Status::permission_denied(format!(
                "feed buffer {path:?} has mode {:o}: others may read or write it (make it 0600)",
                meta.mode() & 0o777
            )));
        }
        Ok(FeedBuffer {
            owner,
            file,
            size: meta.len(),
        })
    }

    /// Its size when attached.
    pub fn size(&self) -> u64 {
        self.size
    }

    fn check(
        &self,
        principal: Principal,
        range: &pb::BufferRange,
        what: &str,
    ) -> Result<(), Status> {
        if principal != self.owner {
            return Err(Status::permission_denied(format!(
                "the feed buffer was attached by {}; {principal} may not use it",
                self.owner
            )));
        }
        match range.offset.checked_add(range.length) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(Status::invalid_argument(format!(
                "{what}: bytes [{}, +{}) lie outside the feed buffer of {} bytes",
                range.offset, range.length, self.size
            ))),
        }
    }

    /// The bytes of each range (one copy each).
    pub fn read(
        &self,
        principal: Principal,
        ranges: &[pb::BufferRange],
    ) -> Result<Vec<Vec<u8>>, Status> {
        for (i, range) in ranges.iter().enumerate() {
            self.check(principal, range, &format!("feed {i}"))?;
        }
        ranges
            .iter()
            .enumerate()
            .map(|(i, range)| {
                let mut bytes = vec![0u8; range.length as usize];
                self.file
                    .read_exact_at(&mut bytes, range.offset)
                    .map_err(|e| {
                        Status::invalid_argument(format!("feed {i}: reading the feed buffer: {e}"))
                    })?;
                Ok(bytes)
            })
            .collect()
    }

    /// Checks where fetches will go, before the iteration runs.
    pub fn check_fetches(
        &self,
        principal: Principal,
        ranges: &[pb::BufferRange],
    ) -> Result<(), Status> {
        for (i, range) in ranges.iter().enumerate() {
            self.check(principal, range, &format!("fetch {i}"))?;
        }
        Ok(())
    }

    /// Writes each fetch into its range (checked by [`FeedBuffer::check_fetches`]).
    pub fn write(&self, fetches: &[Vec<u8>], ranges: &[pb::BufferRange]) -> Result<(), Status> {
        if fetches.len() != ranges.len() {
            return Err(Status::invalid_argument(format!(
                "{} fetch ranges for {} fetches",
                ranges.len(),
                fetches.len()
            )));
        }
        for (i, (bytes, range)) in fetches.iter().zip(ranges).enumerate() {
            if bytes.len() as u64 != range.length {
                return Err(Status::invalid_argument(format!(
                    "fetch {i} has {} bytes; its range has {}",
                    bytes.len(),
                    range.length
                )));
            }
            self.file.write_all_at(bytes, range.offset).map_err(|e| {
                Status::internal(format!("fetch {i}: writing the feed buffer: {e}"))
            })?;
        }
        Ok(())
    }
}

/// The attached buffers, by session.
#[derive(Clone, Default)]
pub struct Buffers(Arc<Mutex<HashMap<u64, Arc<FeedBuffer>>>>);

impl Buffers {
    /// Attaches (or replaces) a session's buffer.
    pub fn attach(&self, session: u64, buffer: FeedBuffer) {
        self.lock().insert(session, Arc::new(buffer));
    }

    /// The session's buffer, if one is attached.
    pub fn get(&self, session: u64) -> Option<Arc<FeedBuffer>> {
        self.lock().get(&session).cloned()
    }

    /// Forgets a closed session's buffer.
    pub fn detach(&self, session: u64) {
        self.lock().remove(&session);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<FeedBuffer>>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}
