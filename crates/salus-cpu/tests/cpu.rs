//! The CPU device end to end on hand-built graphs: results, failures that leave state
//! untouched, feed checks, and concurrent lanes.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use salus_cpu::CpuDevice;
use salus_exec::{Device, ExecError, Location, Placement, Program, RunControl};
use salus_graph::{Attr, DType, Graph, Limits, Node, Op, Role, Tensor, TensorType};

fn tensor(name: &str, dtype: DType, shape: &[u64], role: Role) -> Tensor {
    Tensor {
        name: name.into(),
        ty: TensorType::new(dtype, shape.to_vec()),
        role,
        data: vec![],
    }
}

fn node(op: Op, inputs: &[usize], outputs: &[usize], attrs: &[(&str, Attr)]) -> Node {
    Node {
        // Unique within a graph: named for the tensors it produces.
        name: format!("{op}{outputs:?}"),
        op,
        inputs: inputs.iter().map(|&i| Some(i)).collect(),
        outputs: outputs.iter().map(|&o| Some(o)).collect(),
        attrs: attrs
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect::<BTreeMap<_, _>>(),
        source: String::new(),
    }
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn i64_bytes(values: &[i64]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// The embedding graph on a fresh CPU device, its table holding 1..=8.
fn embedding_session() -> (Program, CpuDevice, Placement) {
    let program = Program::new(salus_graph::samples::embedding_sum(), &Limits::default()).unwrap();
    let device = CpuDevice::new(1 << 16).unwrap();
    let at = Placement {
        persistent: 0,
        lane: 4096,
    };
    let Some(Location::Persistent(off)) = program.location(0) else {
        panic!("the table is persistent")
    };
    let table: Vec<f32> = (1..=8).map(|v| v as f32).collect();
    device
        .write(at.persistent + off, &f32_bytes(&table))
        .unwrap();
    (program, device, at)
}

#[test]
fn runs_an_iteration_and_applies_updates_at_the_end() {
    let (program, device, at) = embedding_session();
    let ids = i64_bytes(&[0, 3, -1]); // rows 0, 3 and 3 (negative wraps)
    let outcome = device.run(&program, at, &[&ids]).unwrap();
    assert_eq!(
        f32s(&outcome.fetches[0]),
        vec![1.0 + 2.0 + 7.0 + 8.0 + 7.0 + 8.0]
    );
    let table = f32s(&device.read(at.persistent, 32).unwrap());
    assert_eq!(table, (1..=8).map(|v| v as f32 * 0.5).collect::<Vec<_>>());
}

#[test]
fn an_out_of_range_index_fails_the_iteration_and_changes_nothing() {
    let (program, device, at) = embedding_session();
    let before = device.read(0, 32).unwrap();
    let err = device
        .run(&program, at, &[&i64_bytes(&[0, 4, 1])])
        .unwrap_err();
    match &err {
        ExecError::Node {
            index: 0,
            op,
            message,
            ..
        } => {
            assert_eq!(op, "embedding");
            assert!(
                message.contains("embedding index 4 is out of range for a dimension of size 4"),
                "{message}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        device.read(0, 32).unwrap(),
        before,
        "no update after a failed iteration"
    );
    // The session goes on: a good iteration after the bad one works.
    device.run(&program, at, &[&i64_bytes(&[1, 1, 1])]).unwrap();
}

#[test]
fn feeds_are_checked() {
    let (program, device, at) = embedding_session();
    let err = device
        .run(&program, at, &[&i64_bytes(&[1, 2])])
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "feed 0 'ids': i64[3] needs 24 bytes, got 16"
    );
    let err = device.run(&program, at, &[]).unwrap_err();
    assert!(err.to_string().contains("takes 1 feeds, 0 given"), "{err}");
}

#[test]
fn overlapping_placements_are_refused() {
    let program = Program::new(salus_graph::samples::embedding_sum(), &Limits::default()).unwrap();
    let device = CpuDevice::new(1 << 16).unwrap();
    let lane = device.write(8192, &[0; 16]);
    assert!(lane.is_ok());
    let err = device
        .run(
            &program,
            Placement {
                persistent: 0,
                lane: 0,
            },
            &[&i64_bytes(&[0, 0, 0])],
        )
        .unwrap_err();
    assert!(err.to_string().contains("in use"), "{err}");
    let err = device.write(1 << 16, &[1]).unwrap_err();
    assert!(err.to_string().contains("outside the arena"), "{err}");
}

/// A small MLP layer chain: fetch = sum(relu(x @ w1) @ w2).
fn mlp_graph() -> Graph {
    Graph {
        tensors: vec![
            tensor("w1", DType::F32, &[16, 32], Role::Parameter),
            tensor("w2", DType::F32, &[32, 8], Role::Parameter),
            tensor("x", DType::F32, &[4, 16], Role::Feed),
            tensor("h", DType::F32, &[4, 32], Role::Intermediate),
            tensor("r", DType::F32, &[4, 32], Role::Intermediate),
            tensor("y", DType::F32, &[4, 8], Role::Intermediate),
            tensor("s", DType::F32, &[], Role::Intermediate),
        ],
        nodes: vec![
            node(Op::Mm, &[2, 0], &[3], &[]),
            node(Op::Relu, &[3], &[4], &[]),
            node(Op::Mm, &[4, 1], &[5], &[]),
            node(
                Op::SumDimIntList,
                &[5],
                &[6],
                &[("keepdim", Attr::Bool(false))],
            ),
        ],
        fetches: vec![6],
        updates: vec![],
        precision: Default::default(),
    }
}

#[test]
fn concurrent_lanes_give_exactly_what_each_gives_alone() {
    let program = Program::new(mlp_graph(), &Limits::default()).unwrap();
    let (p, e) = (
        program.plan().persistent_bytes,
        program.plan().ephemeral_bytes,
    );
    let device = CpuDevice::new(4 * (p + e)).unwrap();
    let sessions: Vec<Placement> = (0..2)
        .map(|i| Placement {
            persistent: i * p,
            lane: 2 * p + i * e,
        })
        .collect();
    for (i, at) in sessions.iter().enumerate() {
        let w: Vec<f32> = (0..(16 * 32 + 32 * 8))
            .map(|k| ((k * (i + 3)) % 17) as f32 / 17.0 - 0.5)
            .collect();
        device.write(at.persistent, &f32_bytes(&w)).unwrap();
    }
    let feeds: Vec<Vec<u8>> = (0..2)
        .map(|i| {
            f32_bytes(
                &(0..64)
                    .map(|k| ((k + i) % 5) as f32 - 2.0)
                    .collect::<Vec<_>>(),
            )
        })
        .collect();
    let alone: Vec<Vec<u8>> = (0..2)
        .map(|i| {
            device
                .run(&program, sessions[i], &[&feeds[i]])
                .unwrap()
                .fetches
                .remove(0)
        })
        .collect();
    let together: Vec<Vec<u8>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|i| {
                let (device, program, feeds, at) = (&device, &program, &feeds, sessions[i]);
                s.spawn(move || {
                    (0..50)
                        .map(|_| {
                            device
                                .run(program, at, &[&feeds[i]])
                                .unwrap()
                                .fetches
                                .remove(0)
                        })
                        .last()
                        .unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(alone, together);
    assert_ne!(alone[0], alone[1]);
}

/// An iteration on a share of the cores (an offline lane beside online ones) gives what
/// it gives on all of them, bit for bit: kernels split outputs, never a sum's order.
#[test]
fn a_share_of_the_cores_gives_the_same_bits() {
    let graph = salus_graph::samples::regression(2048, 256, 64, 0.5);
    let program = Program::new(graph, &Limits::default()).unwrap();
    assert!(!program.is_small(), "big enough to split over threads");
    let plan = program.plan();
    let lane = plan.persistent_bytes.next_multiple_of(256);
    let at = Placement {
        persistent: 0,
        lane,
    };
    let values = |seed: u32, n: usize| -> Vec<f32> {
        (0..n)
            .map(|i| {
                let x = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed);
                (x % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    };
    let x = f32_bytes(&values(1, 2048 * 256));
    let y = f32_bytes(&values(2, 2048 * 64));
    let w = f32_bytes(&values(3, 256 * 64));
    // `shares`: none (`Device::run`), or the shares the iteration is given in turn, the
    // first at its start and each next one 200 us later from another thread; in the
    // background or not.
    let run_as = |shares: &[f64], background: bool| {
        let device = CpuDevice::new(lane + plan.ephemeral_bytes + 256).unwrap();
        device.write(0, &w).unwrap();
        let mut fetches = Vec::new();
        for _ in 0..3 {
            let feeds = [x.as_slice(), y.as_slice()];
            let Some((&first, later)) = shares.split_first() else {
                fetches.push(device.run(&program, at, &feeds).unwrap().fetches);
                continue;
            };
            let control = if background {
                RunControl::background(first)
            } else {
                RunControl::new(first)
            };
            let released = AtomicBool::new(false);
            let out = std::thread::scope(|scope| {
                scope.spawn(|| {
                    for &share in later {
                        std::thread::sleep(Duration::from_micros(200));
                        released.store(share > 0.0, Ordering::SeqCst);
                        control.set_share(share);
                    }
                });
                device.run_with(&program, at, &feeds, &control).unwrap()
            });
            // Held at its start, it ran only once a later share let it.
            assert!(first > 0.0 || released.load(Ordering::SeqCst));
            fetches.push(out.fetches);
        }
        (fetches, device.read(0, w.len() as u64).unwrap())
    };
    let run = |shares: &[f64]| run_as(shares, false);
    let all = run(&[]);
    assert_eq!(run(&[0.5]), all);
    assert_eq!(run(&[0.01]), all);
    // Shares changed while it runs (the offline share following online work), and held
    // at 0 between two nodes.
    assert_eq!(run(&[1.0, 0.5, 0.0, 1.0, 0.01, 0.0, 0.5]), all);
    assert_eq!(run(&[0.0, 0.0, 1.0]), all);
    // In the background, on the idle class's threads.
    assert_eq!(run_as(&[1.0], true), all);
    assert_eq!(run_as(&[1.0, 0.5, 0.0, 1.0], true), all);
}

/// The sample regression graph (`n` rows of `d` inputs, `k` outputs) planned, where it
/// runs (its persistent block first, its lane after) and a device just large enough.
fn regression(n: u64, d: u64, k: u64) -> (Program, Placement, CpuDevice) {
    let graph = salus_graph::samples::regression(n, d, k, 0.5);
    let program = Program::new(graph, &Limits::default()).unwrap();
    let plan = program.plan();
    let lane = plan.persistent_bytes.next_multiple_of(256);
    let device = CpuDevice::new(lane + plan.ephemeral_bytes + 256).unwrap();
    let at = Placement {
        persistent: 0,
        lane,
    };
    (program, at, device)
}

/// Held by the tests that look at threads' classes: one lifts its pool's threads out of
/// the idle class for a while, which another would see (the pools' names are alike).
#[cfg(target_os = "linux")]
static CLASSES: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Each thread of this process: its name (at most 15 bytes: it says which pool the thread
/// belongs to) and its scheduling policy (field 41 of its stat; 5: `SCHED_IDLE`).
#[cfg(target_os = "linux")]
fn thread_policies() -> Vec<(String, u32)> {
    let mut policies = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").unwrap() {
        let dir = task.unwrap().path();
        let (Ok(name), Ok(stat)) = (
            std::fs::read_to_string(dir.join("comm")),
            std::fs::read_to_string(dir.join("stat")),
        ) else {
            continue; // the thread ended meanwhile
        };
        let after_name = &stat[stat.rfind(')').unwrap() + 2..];
        let policy: u32 = after_name.split(' ').nth(38).unwrap().parse().unwrap();
        policies.push((name.trim().to_string(), policy));
    }
    policies
}

/// A background iteration runs on threads of the OS's idle class, which get a core only
/// when no other thread wants it; the others stay as they were.
#[cfg(target_os = "linux")]
#[test]
fn a_background_iteration_runs_on_idle_class_threads() {
    let _classes = CLASSES.lock().unwrap_or_else(|e| e.into_inner());
    let (program, at, device) = regression(2048, 256, 64);
    if !device.has_background_priority() {
        // Linux grants SCHED_IDLE without privilege; a sandbox may still forbid the call.
        eprintln!("skipped: the idle scheduling class is refused to this process");
        return;
    }
    let x = f32_bytes(&vec![0.5; 2048 * 256]);
    let y = f32_bytes(&vec![1.0; 2048 * 64]);
    let feeds = [x.as_slice(), y.as_slice()];
    device
        .run_with(&program, at, &feeds, &RunControl::background(1.0))
        .unwrap();
    let policies = thread_policies();
    let idle: Vec<_> = policies
        .iter()
        .filter(|(name, _)| name.starts_with("salus-cpu-idle"))
        .collect();
    assert!(!idle.is_empty(), "{policies:?}");
    assert!(idle.iter().all(|(_, policy)| *policy == 5), "{policies:?}");
    let mut others = policies
        .iter()
        .filter(|(name, _)| !name.starts_with("salus-cpu-idle"));
    assert!(others.all(|(_, policy)| *policy != 5), "{policies:?}");
}

/// Whether this process may lift a thread out of the idle class: with `CAP_SYS_NICE`
/// (bit 23 of its effective capabilities) or an `RLIMIT_NICE` of 20 or more.
#[cfg(target_os = "linux")]
fn may_leave_the_idle_class() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let capable = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|caps| u64::from_str_radix(caps.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << 23) != 0);
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
    let nice = limits
        .lines()
        .find(|l| l.starts_with("Max nice priority"))
        .and_then(|l| l.split_whitespace().nth(3))
        .is_some_and(|soft| soft == "unlimited" || soft.parse::<u64>().is_ok_and(|n| n >= 20));
    capable || nice
}

/// An abandoned background iteration ends its kernel in progress at ordinary priority: on
/// a host whose every core is busy with other work, where its idle-class threads would
/// get almost no time (a kernel of 100 ms at full speed would take minutes), it stops
/// soon. Its threads go back to the idle class after.
#[cfg(target_os = "linux")]
#[test]
fn an_abandoned_background_iteration_ends_soon_on_a_busy_host() {
    let _classes = CLASSES.lock().unwrap_or_else(|e| e.into_inner());
    let (n, d, k) = (8192, 1024, 256); // matrix products of 2 GFLOP
    let (program, at, device) = regression(n, d, k);
    if !device.has_background_priority() || !may_leave_the_idle_class() {
        eprintln!("skipped: this process may not move threads between scheduling classes");
        return;
    }
    let x = f32_bytes(&vec![0.5; (n * d) as usize]);
    let y = f32_bytes(&vec![1.0; (n * k) as usize]);
    let feeds = [x.as_slice(), y.as_slice()];
    let control = RunControl::background(1.0);
    let busy = AtomicBool::new(true);
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let took = std::thread::scope(|scope| {
        for _ in 0..2 * cores {
            scope.spawn(|| {
                while busy.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            });
        }
        let abandoner = scope.spawn(|| {
            std::thread::sleep(Duration::from_millis(200));
            control.abandon();
            std::time::Instant::now()
        });
        let result = device.run_with(&program, at, &feeds, &control);
        let ended = std::time::Instant::now();
        busy.store(false, Ordering::Relaxed);
        assert!(matches!(result, Err(ExecError::Abandoned)), "{result:?}");
        ended.saturating_duration_since(abandoner.join().unwrap())
    });
    assert!(
        took < Duration::from_secs(20),
        "abandoned, it ran on for {took:?}"
    );
    let policies = thread_policies();
    let idle: Vec<_> = policies
        .iter()
        .filter(|(name, _)| name.starts_with("salus-cpu-idle"))
        .collect();
    assert!(
        !idle.is_empty() && idle.iter().all(|(_, p)| *p == 5),
        "{policies:?}"
    );
}

/// An abandoned iteration stops and keeps nothing: the persistent block is as before, and
/// the iteration run again gives what it would have.
#[test]
fn an_abandoned_iteration_changes_nothing() {
    let (program, at, device) = regression(64, 16, 4);
    let w = f32_bytes(&vec![0.5; 16 * 4]);
    device.write(0, &w).unwrap();
    let x = f32_bytes(&vec![1.0; 64 * 16]);
    let y = f32_bytes(&vec![2.0; 64 * 4]);
    let feeds = [x.as_slice(), y.as_slice()];
    let control = RunControl::new(1.0);
    control.abandon();
    assert_eq!(
        device.run_with(&program, at, &feeds, &control),
        Err(ExecError::Abandoned)
    );
    assert_eq!(device.read(0, w.len() as u64).unwrap(), w);
    // Abandoned while held between two nodes, it stops there.
    let held = RunControl::new(0.0);
    let result = std::thread::scope(|scope| {
        scope.spawn(|| {
            std::thread::sleep(Duration::from_millis(5));
            held.abandon();
        });
        device.run_with(&program, at, &feeds, &held)
    });
    assert_eq!(result, Err(ExecError::Abandoned));
    assert_eq!(device.read(0, w.len() as u64).unwrap(), w);
    let again = device
        .run_with(&program, at, &feeds, &RunControl::new(1.0))
        .unwrap();
    let fresh = CpuDevice::new(device.capacity()).unwrap();
    fresh.write(0, &w).unwrap();
    assert_eq!(
        again.fetches,
        fresh.run(&program, at, &feeds).unwrap().fetches
    );
}
