//! The state directory (`--state-dir`): each session's snapshot, so that a restarted
//! salusd brings its sessions back.
//!
//! A snapshot is one file per session, `session-<id>.snap`: the magic `SALUSSN1`, the
//! session's description (`salus.v1.SessionSnapshot`: owner, kind, hints, reattach token,
//! iterations done, every program's graph) and its persistent block, each preceded by its
//! length, then a 64-bit FNV-1a checksum of everything before it. It is written to a
//! temporary file, synced and renamed over the old one, so a crash leaves the old
//! snapshot or the new one, never a mix; a file whose checksum does not match is set aside
//! (`.rejected`) at start and named in the log.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use prost::Message;
use salus_core::{Hints, SessionClass, SessionKind};
use salus_proto::v1 as pb;

const MAGIC: &[u8; 8] = b"SALUSSN1";

/// What a snapshot holds of one session.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    /// Its id.
    pub id: u64,
    /// Its owner's uid.
    pub owner: u32,
    /// Training or inference.
    pub kind: SessionKind,
    /// Online or offline.
    pub class: SessionClass,
    /// The client's hints.
    pub hints: Hints,
    /// The secret a client reattaches with.
    pub token: [u8; 16],
    /// Iterations done when the snapshot was taken.
    pub iterations: u64,
    /// Its programs, the first defining the persistent block.
    pub programs: Vec<salus_graph::Graph>,
    /// The persistent block.
    pub block: Vec<u8>,
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

fn path_of(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("session-{id}.snap"))
}

impl Snapshot {
    fn encode(&self) -> Vec<u8> {
        let meta = pb::SessionSnapshot {
            session: self.id,
            owner_uid: self.owner,
            kind: match self.kind {
                SessionKind::Training => pb::SessionKind::Training,
                SessionKind::Inference => pb::SessionKind::Inference,
            } as i32,
            hints: Some(crate::service::hints_to_proto(&self.hints, self.class)),
            token: self.token.to_vec(),
            iterations: self.iterations,
            programs: self.programs.iter().map(|g| g.to_proto()).collect(),
        }
        .encode_to_vec();
        let mut out = Vec::with_capacity(8 + 16 + meta.len() + self.block.len() + 8);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&(meta.len() as u64).to_le_bytes());
        out.extend_from_slice(&meta);
        out.extend_from_slice(&(self.block.len() as u64).to_le_bytes());
        out.extend_from_slice(&self.block);
        let sum = fnv1a(&out);
        out.extend_from_slice(&sum.to_le_bytes());
        out
    }

    fn decode(bytes: &[u8]) -> Result<Snapshot, String> {
        let body_len = bytes
            .len()
            .checked_sub(8)
            .ok_or("shorter than its checksum")?;
        let (body, sum) = bytes.split_at(body_len);
        if fnv1a(body) != u64::from_le_bytes(sum.try_into().map_err(|_| "no checksum")?) {
            return Err("its checksum does not match (a torn or damaged file)".into());
        }
        let rest = body
            .strip_prefix(MAGIC)
            .ok_or("not a salus session snapshot")?;
        let (meta, rest) = take(rest)?;
        let (block, rest) = take(rest)?;
        if !rest.is_empty() {
            return Err("bytes after the persistent block".into());
        }
        let meta = pb::SessionSnapshot::decode(meta).map_err(|e| e.to_string())?;
        let (hints, class) = crate::service::hints_from_proto(meta.hints)
            .map_err(|status| format!("its hints: {}", status.message()))?;
        let programs = meta
            .programs
            .iter()
            .map(salus_graph::Graph::from_proto)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("a program: {e}"))?;
        if programs.is_empty() {
            return Err("no program".into());
        }
        Ok(Snapshot {
            id: meta.session,
            owner: meta.owner_uid,
            kind: match pb::SessionKind::try_from(meta.kind) {
                Ok(pb::SessionKind::Inference) => SessionKind::Inference,
                _ => SessionKind::Training,
            },
            class,
            hints,
            token: meta
                .token
                .as_slice()
                .try_into()
                .map_err(|_| "a token of the wrong length")?,
            iterations: meta.iterations,
            programs,
            block: block.to_vec(),
        })
    }
}

fn take(bytes: &[u8]) -> Result<(&[u8], &[u8]), String> {
    let (len, rest) = bytes.split_at_checked(8).ok_or("truncated")?;
    let len = u64::from_le_bytes(len.try_into().map_err(|_| "truncated")?);
    let len = usize::try_from(len).map_err(|_| "a length past memory")?;
    rest.split_at_checked(len)
        .ok_or_else(|| "truncated".to_string())
}

/// Writes `state` atomically (a temporary file, synced, renamed, the directory synced).
pub fn write(dir: &Path, state: &Snapshot) -> std::io::Result<()> {
    let path = path_of(dir, state.id);
    let temporary = dir.join(format!("session-{}.snap.tmp", state.id));
    let mut file = fs::File::create(&temporary)?;
    file.write_all(&state.encode())?;
    file.sync_all()?;
    fs::rename(&temporary, &path)?;
    fs::File::open(dir)?.sync_all()
}

/// Renames a session's snapshot `.rejected` (it could not be restored).
pub fn set_aside(dir: &Path, id: u64) {
    let path = path_of(dir, id);
    let _ = fs::rename(&path, path.with_extension("rejected"));
}

/// Forgets a session's snapshot (it was closed).
pub fn remove(dir: &Path, id: u64) {
    let _ = fs::remove_file(path_of(dir, id));
}

/// The sessions `dir` holds a snapshot of, by their files' names.
pub fn ids(dir: &Path) -> Vec<u64> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name();
            name.to_str()?
                .strip_prefix("session-")?
                .strip_suffix(".snap")?
                .parse()
                .ok()
        })
        .collect()
}

/// Every snapshot in `dir`; a file that cannot be read back is renamed `.rejected` and
/// reported.
pub fn read_all(dir: &Path) -> Vec<Snapshot> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut states = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().and_then(|e| e.to_str()) != Some("snap") {
            continue;
        }
        match fs::read(&path)
            .map_err(|e| e.to_string())
            .and_then(|b| Snapshot::decode(&b))
        {
            Ok(state) => states.push(state),
            Err(why) => {
                tracing::error!(path = %path.display(), %why, "session snapshot set aside");
                let _ = fs::rename(&path, path.with_extension("rejected"));
            }
        }
    }
    states.sort_by_key(|s| s.id);
    states
}
