//! Background iterations in pieces, held to the share of the GPU the scheduler gives
//! them: MuxFlow's kernel-level throttling and dynamic SM shares, done by the device that
//! launches the kernels instead of by intercepting them.
//!
//! A background (offline) lane lowers each program into up to [`MAX_PIECES`] pieces of
//! about as many commands each, cut between nodes, and captures a CUDA graph per piece.
//! Before each piece the lane looks at its iteration's [`RunControl`]:
//!
//! - **abandoned**: what was launched finishes, nothing more starts, and the iteration
//!   fails with [`ExecError::Abandoned`]. Its updates were never written, so the
//!   session's persistent tensors are unchanged.
//! - **share 0**: held, once the pieces launched have finished, until a share comes back.
//! - **share below 1**: the piece runs in a green context with that share of the SMs, in
//!   eighths, the largest at most the share ([`level`]), so the online work keeps the
//!   other SMs whatever the offline kernels do. Partitions are made on first use and
//!   shared by the lanes; each lane makes its own stream in each. Where there are no
//!   green contexts (an older driver or GPU, or `SALUS_CUDA_GREEN=0`), the lane paces
//!   itself instead: after a piece of device time `t` it waits `t (1 - share) / share`,
//!   so that it runs `share` of the time.
//!
//! At most two pieces are queued on the GPU at once, so a new share takes effect within
//! two pieces. A piece's graph is captured on the stream it runs on (a graph's kernels
//! keep the context they were captured in), so each pair of piece and partition is
//! captured once.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::driver::sys;
use salus_exec::{ExecError, RunControl};

use crate::driver::green::{self, SmPartition};
use crate::driver::{self, Raw, driver_error};
use crate::{CudaDevice, Lane};

/// The most pieces a background iteration runs in.
pub(crate) const MAX_PIECES: usize = 16;

/// SM partitions come in this many steps of the whole GPU.
const LEVELS: u32 = 8;

/// Cuts a program's commands (`total`, with `spans` the commands of each node, in order)
/// into at most `most` pieces of about as many commands each, between nodes. One piece
/// (possibly empty) at least.
pub(crate) fn pieces(spans: &[Range<usize>], total: usize, most: usize) -> Vec<Range<usize>> {
    let most = most.max(1);
    let mut out = Vec::new();
    let mut start = 0;
    for span in spans {
        // Piece k ends at the first node boundary at or past k/most of the commands.
        let boundary = ((out.len() + 1) * total).div_ceil(most);
        if span.end >= boundary && span.end > start && out.len() + 1 < most {
            out.push(start..span.end);
            start = span.end;
        }
    }
    if start < total || out.is_empty() {
        out.push(start..total);
    }
    out
}

/// The SM partition, in eighths of the GPU, that holds a piece to `share` of the device
/// (the largest at most the share, so that online work keeps at least the rest; at least
/// one eighth); `None`: the whole GPU.
pub(crate) fn level(share: f64) -> Option<u32> {
    let k = (share.clamp(0.0, 1.0) * f64::from(LEVELS) + 1e-9).floor() as u32;
    (k < LEVELS).then_some(k.max(1))
}

/// The device's SM partitions, by level, made on first use.
pub(crate) struct Partitions {
    dev: sys::CUdevice,
    state: Mutex<PartitionState>,
}

struct PartitionState {
    /// The GPU's SMs, or why background iterations are paced instead.
    sms: Result<u32, String>,
    made: HashMap<u32, Arc<SmPartition>>,
}

impl Partitions {
    pub(crate) fn open(dev: sys::CUdevice) -> Partitions {
        let sms = if std::env::var("SALUS_CUDA_GREEN").as_deref() == Ok("0") {
            Err("SALUS_CUDA_GREEN=0".to_string())
        } else {
            green::device_sms(dev).map_err(|e| driver_error("cuDeviceGetDevResource", e))
        };
        match &sms {
            Ok(n) => tracing::debug!(sms = n, "background iterations run in SM partitions"),
            Err(why) => tracing::info!("no SM partitions ({why}): background iterations are paced"),
        }
        Partitions {
            dev,
            state: Mutex::new(PartitionState {
                sms,
                made: HashMap::new(),
            }),
        }
    }

    /// The partition of `level` eighths of the SMs, made on first use; `None` where the
    /// GPU has none (from the first failure on).
    fn get(&self, level: u32) -> Option<Arc<SmPartition>> {
        let mut state = self.state.lock().ok()?;
        if let Some(p) = state.made.get(&level) {
            return Some(p.clone());
        }
        let sms = *state.sms.as_ref().ok()?;
        let want = (sms * level).div_ceil(LEVELS).max(1);
        match green::sm_partition(self.dev, want) {
            Ok(p) => {
                tracing::info!(
                    level,
                    want,
                    sms = p.sms,
                    "an SM partition for background work"
                );
                let p = Arc::new(p);
                state.made.insert(level, p.clone());
                Some(p)
            }
            Err(e) => {
                let why = driver_error(&format!("a partition of {want} SMs"), e);
                tracing::warn!("{why}: background iterations are paced instead");
                state.sms = Err(why);
                None
            }
        }
    }

    /// How background iterations are held to their share: in SM partitions of the GPU's
    /// SMs, or paced (and why).
    pub(crate) fn describe(&self) -> String {
        match self.state.lock().map(|s| s.sms.clone()) {
            Ok(Ok(sms)) => format!("SM partitions in eighths of {sms} SMs"),
            Ok(Err(why)) => format!("paced ({why})"),
            Err(_) => "paced (lock poisoned)".to_string(),
        }
    }

    /// Destroys the partitions (after every lane's streams in them).
    pub(crate) fn clear(&self) {
        if let Ok(mut state) = self.state.lock() {
            state.made.clear();
        }
    }

    fn disable(&self, why: String) {
        tracing::warn!("{why}: background iterations are paced instead");
        if let Ok(mut state) = self.state.lock() {
            state.sms = Err(why);
        }
    }
}

/// A lane's streams in SM partitions, by level; each keeps its partition alive.
#[derive(Default)]
pub(crate) struct PartitionStreams(HashMap<u32, (Arc<SmPartition>, Raw<sys::CUstream>)>);

impl PartitionStreams {
    /// Destroys the streams (after their work), then lets go of their partitions.
    pub(crate) fn clear(&mut self) {
        for (_, (partition, stream)) in self.0.drain() {
            let _ = driver::sync(stream);
            driver::destroy_stream(stream);
            drop(partition);
        }
    }
}

fn missing() -> ExecError {
    ExecError::Device("internal: entry missing".into())
}

impl CudaDevice {
    /// Runs piece `index` of the entry at `key` on `stream` (of SM partition `level`, 0 for
    /// the lane's own): replaying its graph, capturing one, or eagerly.
    pub(crate) fn piece(
        &self,
        lane: &mut Lane,
        key: (u64, u64),
        index: usize,
        stream: Raw<sys::CUstream>,
        level: u32,
    ) -> Result<(), ExecError> {
        let graphs = self.graphs.load(std::sync::atomic::Ordering::Relaxed);
        let captured = {
            let lane: &Lane = lane;
            let entry = lane.entries.get(&key).ok_or_else(missing)?;
            if graphs && let Some(&g) = entry.graphs.get(&(index, level)) {
                return driver::launch_graph(g, stream).map_err(|e| self.check("cuGraphLaunch", e));
            }
            let range = entry.pieces.get(index).cloned().ok_or_else(missing)?;
            let commands = &entry.commands[range];
            let capture = graphs && entry.runs >= 1 && !entry.capture_failed;
            if !capture || commands.is_empty() {
                return self.issue(lane, stream, commands);
            }
            // The handles point at the capturing stream before the capture begins and back
            // after it ends (pointing cuBLAS resets its workspace, which is set again).
            let (issued, ended) = self.with_handles_on(lane, stream, || {
                driver::begin_capture(stream)
                    .map_err(|e| self.check("cuStreamBeginCapture", e))
                    .map(|()| {
                        let issued = self.issue_on(lane, stream, commands);
                        (issued, driver::end_capture(stream))
                    })
            })??;
            let exec = match (issued, ended) {
                (Ok(()), Ok(g)) => driver::instantiate(g).ok(),
                (_, Ok(g)) => {
                    driver::destroy_graph(g);
                    None
                }
                _ => None,
            };
            if exec.is_none() {
                self.issue(lane, stream, commands)?;
            }
            exec
        };
        let entry = lane.entries.get_mut(&key).ok_or_else(missing)?;
        match captured {
            Some(g) => {
                entry.graphs.insert((index, level), g);
                driver::launch_graph(g, stream).map_err(|e| self.check("cuGraphLaunch", e))
            }
            None => {
                entry.capture_failed = true;
                Ok(())
            }
        }
    }

    /// Runs the nodes of a background iteration piece by piece under `control` (see the
    /// module's doc); on return the lane's own stream is ordered after every piece.
    pub(crate) fn run_pieces(
        &self,
        lane: &mut Lane,
        key: (u64, u64),
        control: &RunControl,
    ) -> Result<(), ExecError> {
        if lane.marks.is_none() {
            let marks = driver::Events::new(5).map_err(|e| self.check("cuEventCreate", e))?;
            lane.marks = Some(marks);
        }
        let count = lane.entries.get(&key).ok_or_else(missing)?.pieces.len();
        let home = lane.stream;
        let mut on = home;
        for index in 0..count {
            let mut share = control.share();
            if share <= 0.0 && !control.abandoned() {
                driver::sync(on).map_err(|e| self.check("holding an offline iteration", e))?;
                share = control.wait_for_share();
            }
            if control.abandoned() {
                self.rejoin(lane, on)?;
                driver::sync(home).map_err(|e| self.check("stopping an abandoned iteration", e))?;
                return Err(ExecError::Abandoned);
            }
            let (before, after, switch) = {
                let marks = lane.marks.as_ref().ok_or_else(missing)?;
                let slot = 2 * (index % 2);
                (marks.get(slot), marks.get(slot + 1), marks.get(4))
            };
            if index >= 2 {
                // The piece two back has finished: at most two are queued.
                driver::event_sync(after).map_err(|e| self.check("cuEventSynchronize", e))?;
            }
            let (mut stream, mut level) = self.stream_for(lane, share);
            if stream.0 != on.0 {
                if !self.order_after(on, stream, switch)? {
                    // No event between the two: the partitions go, the lane's own stream
                    // goes on after the last piece.
                    self.partitions
                        .disable("events do not order an SM partition's stream".into());
                    (stream, level) = (home, 0);
                }
                on = stream;
            }
            driver::record(before, stream).map_err(|e| self.check("cuEventRecord", e))?;
            self.piece(lane, key, index, stream, level)?;
            driver::record(after, stream).map_err(|e| self.check("cuEventRecord", e))?;
            if level == 0 && share < 1.0 && index + 1 < count {
                driver::event_sync(after).map_err(|e| self.check("cuEventSynchronize", e))?;
                let ms = driver::elapsed_ms(before, after)
                    .map_err(|e| self.check("cuEventElapsedTime", e))?;
                let busy = f64::from(ms.max(0.0)) / 1e3;
                control.pause(Duration::from_secs_f64(busy * (1.0 - share) / share));
            }
        }
        self.rejoin(lane, on)
    }

    /// Orders the lane's own stream after the work on `on`.
    fn rejoin(&self, lane: &Lane, on: Raw<sys::CUstream>) -> Result<(), ExecError> {
        if on.0 == lane.stream.0 {
            return Ok(());
        }
        let switch = lane.marks.as_ref().ok_or_else(missing)?.get(4);
        self.order_after(on, lane.stream, switch).map(|_| ())
    }

    /// Orders `next` after the work queued on `on`: by `event` on the GPU where the
    /// driver takes it (true), else by waiting on the host for `on` to finish (false). A
    /// sticky error (a broken context) fails.
    fn order_after(
        &self,
        on: Raw<sys::CUstream>,
        next: Raw<sys::CUstream>,
        event: Raw<sys::CUevent>,
    ) -> Result<bool, ExecError> {
        let ordered = driver::record(event, on).and_then(|()| driver::wait_event(next, event));
        match ordered {
            Ok(()) => Ok(true),
            Err(e) if driver::is_sticky(&e) => Err(self.check("ordering two streams", e)),
            Err(e) => {
                tracing::warn!("{}", driver_error("ordering two streams by an event", e));
                driver::sync(on).map_err(|e| self.check("ordering two streams", e))?;
                Ok(false)
            }
        }
    }

    /// The stream a piece at `share` runs on, and its partition's level (0: the lane's own
    /// stream, on the whole GPU).
    fn stream_for(&self, lane: &mut Lane, share: f64) -> (Raw<sys::CUstream>, u32) {
        let Some(level) = level(share) else {
            return (lane.stream, 0);
        };
        if let Some((_, s)) = lane.partitioned.0.get(&level) {
            return (*s, level);
        }
        let Some(partition) = self.partitions.get(level) else {
            return (lane.stream, 0);
        };
        let priority = self.priorities.map_or(0, |(least, _)| least);
        match green::partition_stream(&partition, priority) {
            Ok(s) => {
                lane.partitioned.0.insert(level, (partition, s));
                (s, level)
            }
            Err(e) => {
                self.partitions
                    .disable(driver_error("a stream in an SM partition", e));
                (lane.stream, 0)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spans(counts: &[usize]) -> (Vec<Range<usize>>, usize) {
        let mut start = 0;
        let spans = counts
            .iter()
            .map(|&n| {
                start += n;
                start - n..start
            })
            .collect();
        (spans, start)
    }

    /// The pieces cover every command once, in order, and cut only between nodes.
    fn check(counts: &[usize], most: usize) -> Vec<Range<usize>> {
        let (spans, total) = spans(counts);
        let cut = pieces(&spans, total, most);
        assert!(!cut.is_empty() && cut.len() <= most.max(1), "{cut:?}");
        assert_eq!(cut[0].start, 0);
        assert_eq!(cut.last().unwrap().end, total);
        for w in cut.windows(2) {
            assert_eq!(w[0].end, w[1].start, "{cut:?}");
            assert!(!w[0].is_empty(), "{cut:?}");
            assert!(
                spans.iter().any(|s| s.end == w[0].end),
                "cut inside a node: {cut:?}"
            );
        }
        cut
    }

    #[test]
    fn pieces_cover_the_commands_between_nodes() {
        assert_eq!(check(&[3, 1, 4], 1), vec![0..8]);
        assert_eq!(check(&[], 16), vec![0..0]);
        assert_eq!(check(&[0, 0], 16), vec![0..0]);
        // 32 one-command nodes in at most 16 pieces: two each.
        let even = check(&[1; 32], 16);
        assert_eq!(even.len(), 16);
        assert!(even.iter().all(|p| p.len() == 2));
        // A node of many commands stays whole; empty nodes never make empty pieces.
        let lumpy = check(&[1, 0, 40, 0, 1, 1, 0, 2], 4);
        assert!(lumpy.iter().any(|p| p.len() >= 40));
        check(&[5, 0, 0, 7, 1, 1, 1, 9, 0, 2, 3], 16);
        check(&[2; 100], 16);
        assert_eq!(check(&[2; 100], 16).len(), 16);
    }

    #[test]
    fn shares_map_to_eighths_of_the_sms() {
        assert_eq!(level(1.0), None);
        // Never more than the share: the learned share's sixteenths round down.
        assert_eq!(level(0.95), Some(7));
        assert_eq!(level(0.9), Some(7));
        assert_eq!(level(0.5), Some(4));
        assert_eq!(level(7.0 / 16.0), Some(3));
        assert_eq!(level(0.3), Some(2));
        assert_eq!(level(0.01), Some(1));
    }
}
