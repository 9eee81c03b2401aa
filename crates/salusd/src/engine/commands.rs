//! The command protocol: what the service asks of the engine, and how the engine answers
//! each request (open, run, read, write, close, policy, drain).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use salus_core::{Event, Hints, PolicyKind, SessionId, SessionKind, SessionSpec};
use salus_exec::{ExecError, Location, Program};
use salus_graph::Role;
use tokio::sync::oneshot;

use super::reports::{
    EventKind, Metrics, NOT_YET_DECIDED, SessionReport, SessionUpdate, StatusReport, UpdateSink,
};
use super::{
    Deferred, EngineError, Entry, HISTOGRAM_BOUNDS, HostImage, Pending, Place, SessionSlot, State,
};
use crate::auth::{Principal, Steering};
use crate::state::Snapshot;

/// Where the engine's answer to one command goes.
pub type Reply<T> = oneshot::Sender<Result<T, EngineError>>;

/// A session as the service hands it to the engine: validated, planned, its initial
/// persistent block assembled on the host.
pub struct NewSession {
    /// Its id, from [`super::Engine::new_session_id`].
    pub id: u64,
    /// Who opened it.
    pub owner: Principal,
    /// Its graph and plan.
    pub program: Program,
    /// The persistent block's initial bytes (P of them).
    pub image: HostImage,
    /// Its place among its owner's sessions ([`super::Quotas::open_session`]).
    pub slot: SessionSlot,
    /// Training or inference.
    pub kind: SessionKind,
    /// Online or offline.
    pub class: salus_core::SessionClass,
    /// The client's hints.
    pub hints: Hints,
    /// Where its updates go.
    pub updates: UpdateSink,
    /// The secret that reattaches it after a restart.
    pub token: [u8; 16],
    /// Present when it comes back from a snapshot, waiting for its client.
    pub restored: Option<Restored>,
}

/// An abandoned iteration's request, to run again as it was.
pub struct Retry {
    pub(super) program: usize,
    pub(super) feeds: Vec<Vec<u8>>,
    pub(super) writes: Vec<(u64, Vec<u8>)>,
    pub(super) arrived: Instant,
}

/// What a session restored from a snapshot brings besides its first program and block.
pub struct Restored {
    /// The iterations it had done.
    pub iterations: u64,
    /// Its further programs, in their order.
    pub programs: Vec<Program>,
}

/// Writes placed in the persistent block: (offset, bytes).
type PlacedWrites = Vec<(u64, Vec<u8>)>;

/// One iteration as a client asks for it.
pub(super) struct Submission {
    program: u32,
    feeds: Vec<Vec<u8>>,
    writes: Vec<(u32, Vec<u8>)>,
    fetch_lengths: Vec<u64>,
}

/// What one iteration gave the client.
#[derive(Debug)]
pub struct RunResult {
    /// The fetches, in graph order.
    pub fetches: Vec<Vec<u8>>,
    /// Time on the device.
    pub device: Duration,
    /// Time from arrival to start.
    pub wait: Duration,
}

/// A request to the engine.
pub enum Command {
    /// Open a session; answered on its update sink.
    Open(Box<NewSession>),
    /// Run one iteration.
    Run {
        /// Who asks.
        principal: Principal,
        /// Which session.
        session: u64,
        /// Which of its programs (0: the one it opened with).
        program: u32,
        /// One buffer per feed.
        feeds: Vec<Vec<u8>>,
        /// Persistent tensors to overwrite just before the iteration: (id, whole bytes).
        writes: Vec<(u32, Vec<u8>)>,
        /// The sizes the client expects its fetches to have (empty: no expectation).
        fetch_lengths: Vec<u64>,
        /// Where the result goes.
        reply: Reply<RunResult>,
    },
    /// Add a program to a session: its step for other feed shapes.
    AddProgram {
        /// Who asks.
        principal: Principal,
        /// Which session.
        session: u64,
        /// The program, planned.
        program: Box<Program>,
        /// Its number in the session.
        reply: Reply<u32>,
    },
    /// A snapshot of a session, taken between its iterations.
    Snapshot {
        /// Which session.
        session: u64,
        /// Its state.
        reply: Reply<Snapshot>,
    },
    /// A client takes back a session restored after a restart.
    Reattach {
        /// Who asks.
        principal: Principal,
        /// Which session.
        session: u64,
        /// The token `opened` gave.
        token: Vec<u8>,
        /// Where its updates go from now on.
        updates: UpdateSink,
        /// Done, or why not.
        reply: Reply<()>,
    },
    /// Close a restored session if its client has not reattached.
    ExpireOrphan(u64),
    /// Whether the principal may use the session (it exists, is theirs, is not closing).
    Owns {
        /// Who asks.
        principal: Principal,
        /// Which session.
        session: u64,
        /// Yes, or why not.
        reply: Reply<()>,
    },
    /// Read persistent tensors between iterations.
    Read {
        /// Who asks.
        principal: Principal,
        /// Which session.
        session: u64,
        /// Tensor ids; empty for every PARAMETER and STATE tensor.
        tensors: Vec<u32>,
        /// (id, bytes) per tensor.
        reply: Reply<Vec<(u32, Vec<u8>)>>,
    },
    /// The programs of a session the principal may use, the one it opened with first:
    /// what a write checks its chunks against, what `Serve` checks a served model against.
    Programs {
        /// Who asks.
        principal: Principal,
        /// Which session.
        session: u64,
        /// Its programs.
        reply: Reply<Vec<Arc<Program>>>,
    },
    /// Overwrite persistent tensors between iterations.
    Write {
        /// Who asks.
        principal: Principal,
        /// Which session.
        session: u64,
        /// (id, bytes) per tensor, each complete.
        tensors: Vec<(u32, Vec<u8>)>,
        /// How many were written.
        reply: Reply<u32>,
    },
    /// Close a session: by request (`reply` set) or because its lease ended.
    Close {
        /// Who asks.
        principal: Principal,
        /// Which session.
        session: u64,
        /// Present for a Close request; absent when the lease ended.
        reply: Option<Reply<()>>,
    },
    /// An iteration finished on the device.
    Finished {
        /// Whose.
        session: SessionId,
        /// What it gave.
        result: Result<salus_exec::Outcome, ExecError>,
        /// When it ended.
        ended: Instant,
        /// The client waiting for it.
        reply: Reply<RunResult>,
        /// Time from arrival to start.
        wait: Duration,
        /// When it was abandoned: what it needs to run again.
        retry: Option<Retry>,
    },
    /// The daemon at a glance.
    Status(Reply<StatusReport>),
    /// Every open session.
    Sessions(Reply<Vec<SessionReport>>),
    /// Numbers for the metrics endpoint.
    Metrics(Reply<Metrics>),
    /// Read or set the policy.
    Policy {
        /// Who asks.
        principal: Principal,
        /// The new policy, or none to read it.
        policy: Option<PolicyKind>,
        /// The policy in force.
        reply: Reply<PolicyKind>,
    },
    /// Enable or disable offline sessions, or read whether they are (`enable: None`).
    Offline {
        /// Who asks.
        principal: Principal,
        /// The new setting.
        enable: Option<bool>,
        /// The health state after the change.
        reply: Reply<salus_core::HealthState>,
    },
    /// The device's load over the last interval (from [`super::Engine::watch_load`]).
    DeviceLoad(salus_exec::Load),
    /// Start or stop draining.
    Drain {
        /// Who asks.
        principal: Principal,
        /// True to drain.
        drain: bool,
        /// Whether it drains now.
        reply: Reply<bool>,
    },
    /// Shut down: drain, let running iterations finish, close every session. Answered
    /// once nothing runs.
    Shutdown {
        /// Answered when every session is closed.
        done: oneshot::Sender<()>,
        /// Where every session's snapshot goes first, when they are kept.
        keep: Option<oneshot::Sender<super::Kept>>,
    },
}

/// Byte range (offset, length) of a persistent tensor within its session's block, checking
/// the id: what reads and writes may touch.
pub fn persistent_range(program: &Program, tensor: u32) -> Result<(u64, u64), EngineError> {
    let t = program
        .graph()
        .tensors
        .get(tensor as usize)
        .ok_or_else(|| EngineError::UnknownTensor {
            tensor,
            count: program.graph().tensors.len(),
        })?;
    match program.location(tensor as usize) {
        Some(Location::Persistent(off)) => Ok((off, program.bytes(tensor as usize))),
        _ => Err(EngineError::NotPersistent {
            tensor,
            name: t.name.clone(),
            role: t.role,
        }),
    }
}

impl State {
    /// Finds a session the principal may use: it exists, they own it (or are root), and
    /// it is not closing. Once shutting down, a session that is gone was closed by the
    /// shutdown (its client comes back after the restart): that is `ShuttingDown`.
    fn owned(&mut self, principal: Principal, session: u64) -> Result<&mut Entry, EngineError> {
        let stopping = self.stopping;
        let entry = self
            .sessions
            .get_mut(&SessionId(session))
            .ok_or(if stopping {
                EngineError::ShuttingDown
            } else {
                EngineError::UnknownSession(session)
            })?;
        principal.check_session(session, entry.owner)?;
        if entry.closing {
            return Err(EngineError::Closing(session));
        }
        Ok(entry)
    }

    /// [`State::owned`], and held by its client: a session restored after a restart
    /// works only once its client has taken it back (its lease). Else a client whose
    /// connection came back by itself would go on using a session with no lease, to see it
    /// closed at `--reattach-timeout`.
    fn attached(&mut self, principal: Principal, session: u64) -> Result<&mut Entry, EngineError> {
        let entry = self.owned(principal, session)?;
        if entry.orphan {
            return Err(EngineError::AwaitingReattach(session));
        }
        Ok(entry)
    }

    pub(super) fn handle(&mut self, command: Command) {
        match command {
            Command::Open(new) => self.open(*new),
            Command::Run {
                principal,
                session,
                program,
                feeds,
                writes,
                fetch_lengths,
                reply,
            } => self.submit(
                principal,
                session,
                Submission {
                    program,
                    feeds,
                    writes,
                    fetch_lengths,
                },
                reply,
            ),
            Command::Owns {
                principal,
                session,
                reply,
            } => drop(reply.send(self.attached(principal, session).map(|_| ()))),
            Command::Snapshot { session, reply } => {
                match self.sessions.get_mut(&SessionId(session)) {
                    None => drop(reply.send(Err(EngineError::UnknownSession(session)))),
                    Some(entry) if entry.running => entry.deferred.push(Deferred::Snapshot(reply)),
                    Some(_) => drop(reply.send(self.snapshot(SessionId(session)))),
                }
            }
            Command::Reattach {
                principal,
                session,
                token,
                updates,
                reply,
            } => drop(reply.send(self.reattach(principal, session, &token, updates))),
            Command::ExpireOrphan(session) => self.expire_orphan(session),
            Command::AddProgram {
                principal,
                session,
                program,
                reply,
            } => {
                let result = self
                    .attached(principal, session)
                    .and_then(|entry| entry.add_program(session, *program));
                let _ = reply.send(result);
            }
            Command::Read {
                principal,
                session,
                tensors,
                reply,
            } => match self.attached(principal, session) {
                Err(error) => drop(reply.send(Err(error))),
                Ok(entry) if entry.running => entry.deferred.push(Deferred::Read(tensors, reply)),
                Ok(_) => drop(reply.send(self.read(SessionId(session), &tensors))),
            },
            Command::Programs {
                principal,
                session,
                reply,
            } => {
                let programs = self
                    .attached(principal, session)
                    .map(|e| e.programs.clone());
                let _ = reply.send(programs);
            }
            Command::Write {
                principal,
                session,
                tensors,
                reply,
            } => match self.attached(principal, session) {
                Err(error) => drop(reply.send(Err(error))),
                Ok(entry) if entry.running => entry.deferred.push(Deferred::Write(tensors, reply)),
                Ok(_) => drop(reply.send(self.write(SessionId(session), &tensors))),
            },
            Command::Close {
                principal: _,
                session,
                reply: None,
            } => {
                // A lease that ended: the session may already be gone.
                if self.sessions.contains_key(&SessionId(session)) {
                    self.close(SessionId(session), "the client went away");
                }
            }
            Command::Close {
                principal,
                session,
                reply: Some(reply),
            } => {
                let result = self.owned(principal, session).map(|_| ());
                if result.is_ok() {
                    self.close(SessionId(session), "closed by the client");
                }
                let _ = reply.send(result);
            }
            Command::Finished {
                session,
                result,
                ended,
                reply,
                wait,
                retry,
            } => self.finished(session, result, ended, reply, wait, retry),
            Command::Status(reply) => drop(reply.send(Ok(self.status()))),
            Command::Sessions(reply) => drop(reply.send(Ok(self.session_reports()))),
            Command::Metrics(reply) => drop(reply.send(Ok(self.metrics()))),
            Command::Policy {
                principal,
                policy,
                reply,
            } => {
                let result = match policy {
                    None => Ok(self.core.policy()),
                    Some(policy) => principal
                        .check_steering(Steering::Policy, self.daemon_uid)
                        .map_err(EngineError::from)
                        .and_then(|()| self.set_policy(policy).map(|()| policy)),
                };
                let _ = reply.send(result);
            }
            Command::Offline {
                principal,
                enable,
                reply,
            } => {
                let result = match enable {
                    None => Ok(()),
                    Some(enable) => principal
                        .check_steering(Steering::Offline, self.daemon_uid)
                        .map_err(EngineError::from)
                        .and_then(|()| self.set_offline(enable)),
                }
                .map(|()| self.core.health());
                let _ = reply.send(result);
            }
            Command::DeviceLoad(load) => {
                let sample = salus_core::DeviceSample {
                    sm_activity: load.sm_activity,
                    sm_clock: load.sm_clock,
                };
                if let Err(error) = self.core(Event::DeviceSampled(sample)) {
                    tracing::error!(%error, "the core refused a device sample");
                }
            }
            Command::Drain {
                principal,
                drain,
                reply,
            } => {
                let result = principal
                    .check_steering(Steering::Drain, self.daemon_uid)
                    .map_err(EngineError::from)
                    .and_then(|()| self.set_draining(drain).map(|()| drain));
                let _ = reply.send(result);
            }
            Command::Shutdown { done, keep } => {
                self.stopping = true;
                if let Err(error) = self.set_draining(true) {
                    tracing::error!(%error, "drain refused by the scheduler");
                }
                self.shutdown = Some(done);
                self.keep = keep;
            }
        }
    }

    fn set_policy(&mut self, policy: PolicyKind) -> Result<(), EngineError> {
        if policy != self.core.policy() {
            self.core(Event::PolicyChanged(policy))?;
            tracing::info!(%policy, "policy changed");
            self.event(
                EventKind::PolicyChanged,
                None,
                None,
                policy.to_string(),
                Duration::ZERO,
            );
        }
        Ok(())
    }

    fn set_offline(&mut self, enable: bool) -> Result<(), EngineError> {
        self.core(Event::OfflineEnabled(enable))?;
        tracing::info!(
            enable,
            "offline sessions {}",
            if enable { "enabled" } else { "disabled" }
        );
        self.event(
            EventKind::Protection,
            None,
            None,
            format!(
                "offline sessions {}",
                if enable { "enabled" } else { "disabled" }
            ),
            Duration::ZERO,
        );
        Ok(())
    }

    fn set_draining(&mut self, drain: bool) -> Result<(), EngineError> {
        if drain != self.core.draining() {
            self.core(Event::DrainingChanged(drain))?;
            tracing::info!(drain, "draining changed");
            self.event(
                EventKind::Draining,
                None,
                None,
                if drain { "draining" } else { "admitting" }.into(),
                Duration::ZERO,
            );
        }
        Ok(())
    }

    fn open(&mut self, new: NewSession) {
        let id = SessionId(new.id);
        let plan = new.program.plan();
        let (p, e, planned_e) = (
            plan.persistent_bytes,
            plan.ephemeral_bytes.max(1),
            plan.ephemeral_bytes,
        );
        let spec = SessionSpec {
            id,
            kind: new.kind,
            class: new.class,
            persistent_bytes: p,
            ephemeral_bytes: e,
            hints: new.hints.clone(),
        };
        if let Err(error) = self.core(Event::SessionOpened(spec)) {
            (new.updates)(Err(error));
            return;
        }
        let entry = Entry {
            owner: new.owner,
            _slot: new.slot,
            token: new.token,
            iterations_before: new.restored.as_ref().map_or(0, |r| r.iterations),
            orphan: new.restored.is_some(),
            programs: std::iter::once(new.program)
                .chain(new.restored.into_iter().flat_map(|r| r.programs))
                .map(Arc::new)
                .collect(),
            hints: new.hints,
            image: Some(new.image),
            place: Place::Queued,
            reason: NOT_YET_DECIDED.into(),
            running: false,
            closing: false,
            pending: VecDeque::new(),
            control: None,
            deferred: Vec::new(),
            updates: new.updates,
            opened: Instant::now(),
            recent: VecDeque::new(),
            histogram: [0; HISTOGRAM_BOUNDS.len() + 1],
            iteration_seconds: 0.0,
        };
        entry.send(SessionUpdate::Opened {
            session: id,
            persistent_bytes: p,
            ephemeral_bytes: planned_e,
            token: entry.token,
            iterations: entry.iterations_before,
        });
        tracing::info!(session = id.0, name = %entry.hints.name, owner = entry.owner.uid, p, e, "opened");
        self.event(
            EventKind::Opened,
            Some(id),
            None,
            format!("{} (P {p} B, E {e} B)", entry.hints.name),
            Duration::ZERO,
        );
        self.sessions.insert(id, entry);
    }

    fn submit(
        &mut self,
        principal: Principal,
        session: u64,
        work: Submission,
        reply: Reply<RunResult>,
    ) {
        let entry = match self.attached(principal, session) {
            Ok(entry) => entry,
            Err(error) => {
                let _ = reply.send(Err(error));
                return;
            }
        };
        let program = work.program;
        let (feeds, writes) = match Self::checked(entry, session, work) {
            Ok(checked) => checked,
            Err(error) => {
                let _ = reply.send(Err(error));
                return;
            }
        };
        entry.pending.push_back(Pending {
            program: program as usize,
            feeds,
            writes,
            reply,
            arrived: Instant::now(),
        });
        if let Err(error) = self.core(Event::IterationSubmitted(SessionId(session)))
            && let Some(entry) = self.sessions.get_mut(&SessionId(session))
            && let Some(pending) = entry.pending.pop_back()
        {
            let _ = pending.reply.send(Err(error));
        }
    }

    pub(super) fn close(&mut self, id: SessionId, why: &'static str) {
        let Some(entry) = self.sessions.get_mut(&id) else {
            return;
        };
        if entry.closing {
            return;
        }
        entry.closing = true;
        for pending in entry.pending.drain(..) {
            let _ = pending
                .reply
                .send(Err(EngineError::ClosedBeforeStart { session: id.0, why }));
        }
        tracing::info!(session = id.0, why, "closing");
        if let Err(error) = self.core(Event::SessionClosed(id)) {
            tracing::error!(session = id.0, %error, "close refused by the scheduler");
        }
    }

    /// An iteration's request checked against the session before it is queued: the
    /// program exists, the feeds fit it, the writes are whole persistent tensors, the
    /// fetch sizes (if given) are its. Returns the feeds and the placed writes.
    fn checked(
        entry: &Entry,
        session: u64,
        work: Submission,
    ) -> Result<(Vec<Vec<u8>>, PlacedWrites), EngineError> {
        let run = entry
            .programs
            .get(work.program as usize)
            .ok_or(EngineError::UnknownProgram {
                session,
                program: work.program,
                count: entry.programs.len(),
            })?;
        let views: Vec<&[u8]> = work.feeds.iter().map(Vec::as_slice).collect();
        run.check_feeds(&views)
            .map_err(|error| EngineError::Feeds { session, error })?;
        if !work.fetch_lengths.is_empty() {
            let sizes: Vec<u64> = run.graph().fetches.iter().map(|&t| run.bytes(t)).collect();
            if sizes != work.fetch_lengths {
                return Err(EngineError::FetchSizes {
                    session,
                    expected: sizes,
                    given: work.fetch_lengths,
                });
            }
        }
        let writes = Self::placed_writes(entry.program(), work.writes)?;
        Ok((work.feeds, writes))
    }

    /// Where in the persistent block each whole-tensor write goes; refuses a tensor that
    /// is not persistent, bytes of the wrong size, and a tensor written twice.
    fn write_offsets(
        program: &Program,
        tensors: &[(u32, Vec<u8>)],
        request: &'static str,
    ) -> Result<Vec<u64>, EngineError> {
        let mut offsets = Vec::with_capacity(tensors.len());
        for (i, (tensor, bytes)) in tensors.iter().enumerate() {
            let (off, len) = persistent_range(program, *tensor)?;
            let t = &program.graph().tensors[*tensor as usize];
            if bytes.len() as u64 != len {
                return Err(EngineError::TensorSize {
                    tensor: *tensor,
                    name: t.name.clone(),
                    ty: t.ty.to_string(),
                    expected: len,
                    got: bytes.len(),
                });
            }
            if tensors[..i].iter().any(|(other, _)| other == tensor) {
                return Err(EngineError::DuplicateTensor {
                    request,
                    tensor: *tensor,
                });
            }
            offsets.push(off);
        }
        Ok(offsets)
    }

    /// An iteration's writes, checked, with their offsets in the persistent block.
    fn placed_writes(
        program: &Program,
        writes: Vec<(u32, Vec<u8>)>,
    ) -> Result<Vec<(u64, Vec<u8>)>, EngineError> {
        let offsets = Self::write_offsets(program, &writes, "RunRequest.writes")?;
        Ok(offsets
            .into_iter()
            .zip(writes.into_iter().map(|(_, b)| b))
            .collect())
    }

    pub(super) fn read(
        &self,
        id: SessionId,
        tensors: &[u32],
    ) -> Result<Vec<(u32, Vec<u8>)>, EngineError> {
        let entry = self
            .sessions
            .get(&id)
            .ok_or(EngineError::UnknownSession(id.0))?;
        let program = entry.program();
        let ids: Vec<u32> = if tensors.is_empty() {
            program
                .graph()
                .tensors
                .iter()
                .enumerate()
                .filter(|(_, t)| matches!(t.role, Role::Parameter | Role::State))
                .map(|(i, _)| i as u32)
                .collect()
        } else {
            // Each tensor once: a read is at most the session's P bytes.
            let mut seen = std::collections::HashSet::with_capacity(tensors.len());
            if let Some(&tensor) = tensors.iter().find(|&&t| !seen.insert(t)) {
                return Err(EngineError::DuplicateTensor {
                    request: "ReadTensors",
                    tensor,
                });
            }
            tensors.to_vec()
        };
        let mut out = Vec::with_capacity(ids.len());
        for tensor in ids {
            let (off, len) = persistent_range(program, tensor)?;
            let bytes = match (&entry.image, entry.place) {
                (Some(image), _) => image.bytes[off as usize..(off + len) as usize].to_vec(),
                (None, Place::Admitted { persistent }) => self
                    .device
                    .read(persistent + off, len)
                    .map_err(EngineError::Exec)?,
                (None, _) => return Err(EngineError::NoTensorCopy(id.0)),
            };
            out.push((tensor, bytes));
        }
        Ok(out)
    }

    pub(super) fn write(
        &mut self,
        id: SessionId,
        tensors: &[(u32, Vec<u8>)],
    ) -> Result<u32, EngineError> {
        let entry = self
            .sessions
            .get_mut(&id)
            .ok_or(EngineError::UnknownSession(id.0))?;
        // Check everything before changing anything: all or nothing.
        let ranges = Self::write_offsets(entry.program(), tensors, "WriteTensors")?;
        for ((_, bytes), off) in tensors.iter().zip(ranges) {
            match (&mut entry.image, entry.place) {
                (Some(image), _) => {
                    image.bytes[off as usize..off as usize + bytes.len()].copy_from_slice(bytes);
                }
                (None, Place::Admitted { persistent }) => self
                    .device
                    .write(persistent + off, bytes)
                    .map_err(EngineError::Exec)?,
                (None, _) => return Err(EngineError::NoTensorCopy(id.0)),
            }
        }
        Ok(tensors.len() as u32)
    }
}
