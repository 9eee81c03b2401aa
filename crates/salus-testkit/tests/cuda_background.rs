//! Background (offline) iterations on the GPU, run in pieces and held to the share of
//! the device the scheduler gives them (`salus-cuda`'s `pieces`). Every test needs a GPU:
//! where there is none (CI), each prints why and passes without running.
//! `scripts/gpu-check.sh` runs them twice: with SM partitions (green contexts) and with
//! `SALUS_CUDA_GREEN=0` (pacing).

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use salus_cuda::{CudaDevice, CudaOptions};
use salus_exec::{Device, ExecError, Placement, Program, RunControl};
use salus_graph::{Limits, samples};

/// A regression step of `n` rows, `d` inputs and `k` outputs on the GPU, with a
/// foreground and a background placement of the same program, both from zero
/// parameters; `None` (printed) without a GPU.
struct Setup {
    gpu: Arc<CudaDevice>,
    program: Program,
    foreground: Placement,
    background: Placement,
    feeds: Vec<Vec<u8>>,
}

fn setup(test: &str, (n, d, k): (u64, u64, u64)) -> Option<Setup> {
    let mut options = CudaOptions::new(0);
    options.cap = Some(2 << 30);
    let gpu = match CudaDevice::new(&options) {
        Ok(d) => d,
        Err(reason) => {
            eprintln!("{test}: skipped: no usable GPU ({reason})");
            return None;
        }
    };
    eprintln!("{test}: background iterations: {}", gpu.background_mode());
    let program = Program::new(samples::regression(n, d, k, 0.01), &Limits::default()).unwrap();
    let plan = program.plan().clone();
    let lane = plan.ephemeral_bytes.div_ceil(256) * 256;
    let block = plan.persistent_bytes.div_ceil(256) * 256;
    let mut seed = 0x9e37_79b9_u32;
    let mut data = |len: u64| -> Vec<u8> {
        (0..len)
            .flat_map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 17;
                seed ^= seed << 5;
                ((f64::from(seed) / f64::from(u32::MAX)) as f32 - 0.5).to_le_bytes()
            })
            .collect()
    };
    let feeds = vec![data(n * d), data(n * k)];
    let setup = Setup {
        gpu: Arc::new(gpu),
        program,
        foreground: Placement {
            persistent: 0,
            lane: 2 * block,
        },
        background: Placement {
            persistent: block,
            lane: 2 * block + lane,
        },
        feeds,
    };
    setup.reset();
    Some(setup)
}

impl Setup {
    fn feeds(&self) -> Vec<&[u8]> {
        self.feeds.iter().map(Vec::as_slice).collect()
    }

    fn persistent(&self, at: Placement) -> Vec<u8> {
        let bytes = self.program.plan().persistent_bytes;
        self.gpu.read(at.persistent, bytes).unwrap()
    }

    /// Both placements back to zero parameters.
    fn reset(&self) {
        let zeros = vec![0u8; self.program.plan().persistent_bytes as usize];
        self.gpu.write(self.foreground.persistent, &zeros).unwrap();
        self.gpu.write(self.background.persistent, &zeros).unwrap();
    }

    fn step(&self) -> Vec<Vec<u8>> {
        let feeds = self.feeds();
        let out = self.gpu.run(&self.program, self.foreground, &feeds);
        out.unwrap().fetches
    }

    fn background_step(&self, control: &RunControl) -> Result<Vec<Vec<u8>>, ExecError> {
        let feeds = self.feeds();
        let out = self
            .gpu
            .run_with(&self.program, self.background, &feeds, control);
        out.map(|o| o.fetches)
    }
}

#[test]
fn background_iterations_compute_the_same_at_every_share() {
    let Some(s) = setup("background_shares", (256, 512, 256)) else {
        return;
    };
    for share in [1.0, 0.5, 0.3, 0.125] {
        s.reset();
        let control = RunControl::background(share);
        // Eager, captured and replayed pieces, in the share's SM partition or paced.
        for step in 0..4 {
            let a = s.step();
            let b = s.background_step(&control).unwrap();
            assert_eq!(a, b, "share {share}, step {step}");
        }
        assert_eq!(s.persistent(s.foreground), s.persistent(s.background));
    }
    // The share changing between iterations and while one runs (from another thread).
    s.reset();
    let control = Arc::new(RunControl::background(1.0));
    std::thread::scope(|scope| {
        let c = control.clone();
        let changer = scope.spawn(move || {
            for k in 0..200 {
                c.set_share([0.25, 1.0, 0.6, 0.1][k % 4]);
                std::thread::sleep(Duration::from_micros(300));
            }
            c.set_share(1.0);
        });
        for step in 0..12 {
            let a = s.step();
            let b = s.background_step(&control).unwrap();
            assert_eq!(a, b, "changing share, step {step}");
        }
        changer.join().unwrap();
    });
    assert_eq!(s.persistent(s.foreground), s.persistent(s.background));
}

#[test]
fn a_held_background_iteration_waits_and_an_abandoned_one_changes_nothing() {
    let Some(s) = setup("background_hold", (256, 512, 256)) else {
        return;
    };
    let s = Arc::new(s);
    for _ in 0..2 {
        s.step();
        s.background_step(&RunControl::background(1.0)).unwrap();
    }
    // Held at share 0: nothing finishes until a share comes.
    let expected = s.step();
    let control = Arc::new(RunControl::background(0.0));
    let (tx, rx) = mpsc::channel();
    let worker = {
        let (s, control) = (s.clone(), control.clone());
        std::thread::spawn(move || tx.send(s.background_step(&control)).unwrap())
    };
    assert!(
        rx.recv_timeout(Duration::from_millis(300)).is_err(),
        "a background iteration at share 0 ran"
    );
    control.set_share(0.5);
    let held = rx.recv_timeout(Duration::from_secs(30)).unwrap();
    worker.join().unwrap();
    assert_eq!(held.unwrap(), expected);
    assert_eq!(s.persistent(s.foreground), s.persistent(s.background));
    // Abandoned while held: it fails, the parameters are unchanged, and the next
    // iteration gives what it would have.
    let before = s.persistent(s.background);
    let control = Arc::new(RunControl::background(0.0));
    let worker = {
        let (s, control) = (s.clone(), control.clone());
        std::thread::spawn(move || s.background_step(&control))
    };
    std::thread::sleep(Duration::from_millis(100));
    control.abandon();
    assert!(matches!(worker.join().unwrap(), Err(ExecError::Abandoned)));
    assert_eq!(s.persistent(s.background), before);
    let expected = s.step();
    assert_eq!(
        s.background_step(&RunControl::background(1.0)).unwrap(),
        expected
    );
    // Abandoned while it runs, from another thread: either it finished first or it
    // changed nothing.
    for delay in [0, 50, 200, 1000] {
        let before = s.persistent(s.background);
        let control = Arc::new(RunControl::background(0.2));
        let worker = {
            let (s, control) = (s.clone(), control.clone());
            std::thread::spawn(move || s.background_step(&control))
        };
        std::thread::sleep(Duration::from_micros(delay));
        control.abandon();
        match worker.join().unwrap() {
            Err(ExecError::Abandoned) => assert_eq!(s.persistent(s.background), before),
            Ok(_) => {
                s.step();
            }
            Err(e) => panic!("abandoned iteration failed otherwise: {e}"),
        }
        assert_eq!(s.persistent(s.foreground), s.persistent(s.background));
    }
}

/// The median of `runs` timings of `f`.
fn median(runs: usize, mut f: impl FnMut()) -> Duration {
    let mut times: Vec<Duration> = (0..runs)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .collect();
    times.sort();
    times[runs / 2]
}

#[test]
fn a_background_iteration_at_a_quarter_share_takes_longer_and_slows_others_less() {
    // About 0.2 TFLOP a step: long enough that an SM share or a duty shows.
    let Some(s) = setup("background_quarter", (4096, 4096, 2048)) else {
        return;
    };
    let (full, quarter) = (RunControl::background(1.0), RunControl::background(0.25));
    for _ in 0..3 {
        s.step();
        s.background_step(&full).unwrap();
        s.background_step(&quarter).unwrap();
    }
    let alone_full = median(7, || {
        s.background_step(&full).unwrap();
    });
    let alone_quarter = median(7, || {
        s.background_step(&quarter).unwrap();
    });
    let foreground = median(7, || {
        s.step();
    });
    // The foreground beside a background lane running flat out, at either share.
    let beside = |control: &RunControl| {
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    s.background_step(control).unwrap();
                }
            });
            std::thread::sleep(Duration::from_millis(20));
            let t = median(9, || {
                s.step();
            });
            done.store(true, std::sync::atomic::Ordering::Relaxed);
            t
        })
    };
    let (beside_full, beside_quarter) = (beside(&full), beside(&quarter));
    eprintln!(
        "background_quarter ({}): background step alone {alone_full:?} at share 1, \
         {alone_quarter:?} at 0.25 ({:.2}x); foreground alone {foreground:?}, beside share 1 \
         {beside_full:?} ({:.2}x), beside share 0.25 {beside_quarter:?} ({:.2}x)",
        s.gpu.background_mode(),
        alone_quarter.as_secs_f64() / alone_full.as_secs_f64(),
        beside_full.as_secs_f64() / foreground.as_secs_f64(),
        beside_quarter.as_secs_f64() / foreground.as_secs_f64(),
    );
    assert!(
        alone_quarter.as_secs_f64() > 1.5 * alone_full.as_secs_f64(),
        "a quarter share ran at {alone_quarter:?} against {alone_full:?} for the whole GPU"
    );
}
