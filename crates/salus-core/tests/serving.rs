//! The request schedulers' decisions, fed events and checked action by action, and the
//! promises every one of them keeps whatever the events (property tests).

#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::time::Duration;

use proptest::prelude::*;
use salus_core::serving::{
    AppId, Batch, BatchId, DropReason, Request, RequestAction, RequestEvent, RequestId,
    RequestScheduler, RequestSchedulerKind, ServingConfig, ServingError,
};

fn ms(t: u64) -> Duration {
    Duration::from_millis(t)
}

/// Feeds a scheduler and keeps what it decided.
struct Drive {
    s: Box<dyn RequestScheduler>,
    now: Duration,
    /// The running batch and when it started.
    running: Option<(Batch, Duration)>,
    batches: Vec<Batch>,
    drops: Vec<(RequestId, DropReason)>,
}

impl Drive {
    fn new(kind: RequestSchedulerKind, config: ServingConfig) -> Self {
        Drive {
            s: kind.build(config).unwrap(),
            now: Duration::ZERO,
            running: None,
            batches: Vec::new(),
            drops: Vec::new(),
        }
    }

    fn handle(&mut self, at: Duration, event: RequestEvent) {
        self.now = at;
        self.s.handle(at, event).unwrap();
        for action in self.s.poll() {
            match action {
                RequestAction::RunBatch(b) => {
                    assert!(self.running.is_none(), "a batch started while one runs");
                    self.running = Some((b.clone(), at));
                    self.batches.push(b);
                }
                RequestAction::Drop { request, reason } => self.drops.push((request, reason)),
            }
        }
    }

    /// Profiled solo times of `app`, at the current time.
    fn profile(&mut self, app: u32, solo_ms: &[u64]) {
        for &t in solo_ms {
            let event = RequestEvent::Profiled {
                app: AppId(app),
                execution: ms(t),
            };
            self.handle(self.now, event);
        }
    }

    fn arrive(&mut self, at: u64, id: u64, app: u32, deadline: u64) {
        let request = Request {
            id: RequestId(id),
            app: AppId(app),
            arrival: ms(at),
            deadline: ms(deadline),
        };
        self.handle(ms(at), RequestEvent::Arrived(request));
    }

    fn finish(&mut self, at: u64) {
        let (batch, started) = self.running.take().unwrap();
        let event = RequestEvent::BatchFinished {
            batch: batch.id,
            duration: ms(at) - started,
        };
        self.handle(ms(at), event);
    }

    fn tick(&mut self, at: Duration) {
        self.handle(at, RequestEvent::Tick);
    }

    fn last(&self) -> (usize, Vec<u64>) {
        let b = self.batches.last().unwrap();
        (b.batch_size, b.requests.iter().map(|r| r.0).collect())
    }

    fn dropped(&self) -> Vec<(u64, DropReason)> {
        self.drops.iter().map(|&(r, why)| (r.0, why)).collect()
    }
}

fn drive(kind: RequestSchedulerKind) -> Drive {
    Drive::new(kind, ServingConfig::default())
}

#[test]
fn fifo_batches_the_oldest_and_pads_to_a_batch_size() {
    let mut d = drive(RequestSchedulerKind::Fifo);
    d.arrive(0, 0, 0, 1000);
    assert_eq!(
        d.last(),
        (1, vec![0]),
        "an idle worker takes the first at once"
    );
    for id in 1..=20 {
        d.arrive(id, id, 0, 2000 - id);
    }
    d.finish(30);
    assert_eq!(
        d.last(),
        (16, (1..=16).collect()),
        "arrival order, 16 at most"
    );
    d.finish(100);
    assert_eq!(
        d.last(),
        (4, vec![17, 18, 19, 20]),
        "four requests run at size 4"
    );
}

#[test]
fn edf_batches_the_most_urgent_and_drops_the_expired() {
    let mut d = drive(RequestSchedulerKind::Edf);
    d.arrive(0, 0, 0, 1000);
    d.arrive(1, 1, 0, 900);
    d.arrive(2, 2, 0, 50);
    d.arrive(3, 3, 0, 300);
    d.finish(60);
    assert_eq!(d.dropped(), vec![(2, DropReason::Expired)]);
    assert_eq!(d.last(), (2, vec![3, 1]));
}

#[test]
fn clipper_grows_its_batch_additively_and_shrinks_it_multiplicatively() {
    let mut d = drive(RequestSchedulerKind::Clipper);
    let mut id = 0;
    let mut at = 0;
    let mut sizes = Vec::new();
    // Plenty queued, SLO 100 ms: batches of up to 10 take 50 ms, larger ones 150 ms.
    for _ in 0..40 {
        d.arrive(at, id, 0, at + 100_000);
        id += 1;
    }
    d.arrive(at, id, 0, at + 100);
    id += 1;
    for _ in 0..14 {
        for _ in 0..12 {
            d.arrive(at, id, 0, at + 100);
            id += 1;
        }
        let n = d.batches.last().unwrap().requests.len();
        sizes.push(n);
        at += if n > 10 { 150 } else { 50 };
        d.finish(at);
    }
    assert_eq!(
        &sizes[..4],
        &[1, 2, 3, 4],
        "one more after each batch within the SLO"
    );
    let peak = sizes.iter().position(|&n| n > 10).unwrap();
    assert!(
        sizes[peak + 1] < sizes[peak],
        "fewer after one over the SLO: {sizes:?}"
    );
}

#[test]
fn nexus_waits_for_its_batch_or_its_duty_cycle_and_drops_early() {
    let mut d = drive(RequestSchedulerKind::Nexus);
    d.profile(0, &[10; 20]);
    // A steady 1 request per ms for a second, SLO 100 ms: the plan batches.
    d.arrive(0, 0, 0, 100);
    assert_eq!(d.last(), (1, vec![0]));
    for i in 1..200 {
        d.arrive(i, i, 0, i + 100);
        if d.running.is_some() && d.now >= ms(10) + d.running.as_ref().unwrap().1 {
            d.finish(i);
        }
    }
    let sizes: BTreeSet<usize> = d.batches.iter().map(|b| b.batch_size).collect();
    assert!(sizes.iter().any(|&s| s >= 8), "{sizes:?}");
    // Nothing else arrives. Once fewer than a batch wait, the worker idles until the next
    // duty cycle, and then serves them.
    let mut at = 200;
    while d.running.is_some() {
        at += 10;
        d.finish(at);
    }
    if d.s.pending() > 0 {
        let wake = d.s.poll_timeout().expect("the next duty cycle is due");
        assert!(wake > ms(at));
        d.tick(wake);
        assert!(d.running.is_some());
    }
    // A request with less slack than the planned batch latency is dropped at dispatch.
    let mut d = drive(RequestSchedulerKind::Nexus);
    d.profile(0, &[40; 20]);
    d.arrive(0, 0, 0, 1000);
    d.arrive(1, 1, 0, 70);
    d.finish(41);
    assert_eq!(d.dropped(), vec![(1, DropReason::Hopeless)]);
}

#[test]
fn clockwork_plans_ahead_and_a_late_batch_fails_the_next() {
    let mut d = drive(RequestSchedulerKind::Clockwork);
    d.profile(0, &[20; 50]);
    d.arrive(0, 0, 0, 1000);
    assert_eq!(d.last(), (1, vec![0]));
    d.arrive(1, 1, 0, 1000);
    // Expected to end at 20 ms; the next batch is planned 10 ms before, with a window of
    // 10 ms after its planned start.
    assert_eq!(d.s.poll_timeout(), Some(ms(10)));
    d.tick(ms(10));
    assert_eq!(d.batches.len(), 1, "planned, not started");
    d.arrive(11, 2, 0, 1000);
    d.finish(25);
    assert_eq!(d.last(), (1, vec![1]), "within the window: runs");
    d.tick(d.s.poll_timeout().unwrap());
    d.finish(80);
    assert_eq!(
        d.dropped(),
        vec![(2, DropReason::MissedStartWindow)],
        "planned at 40 ms for 50 ms, so 60 ms at the latest"
    );
}

#[test]
fn clockwork_drops_requests_no_batch_size_can_serve() {
    let mut d = drive(RequestSchedulerKind::Clockwork);
    d.profile(0, &[20; 50]);
    d.arrive(0, 0, 0, 1000);
    d.arrive(1, 1, 0, 30);
    d.finish(20);
    assert_eq!(d.dropped(), vec![(1, DropReason::Hopeless)]);
}

/// ORLOJ with a short application (10 ms) and a long one (50 ms), the profile refreshed
/// at every change.
fn orloj() -> Drive {
    let config = ServingConfig {
        profile_refresh: 1,
        ..ServingConfig::default()
    };
    let mut d = Drive::new(RequestSchedulerKind::Orloj, config);
    d.profile(0, &[10; 50]);
    d.profile(1, &[50; 50]);
    d
}

#[test]
fn orloj_forms_the_largest_batch_its_queues_can_fill() {
    let mut d = orloj();
    d.arrive(0, 0, 0, 10_000);
    assert_eq!(d.last(), (1, vec![0]));
    for id in 1..=11 {
        d.arrive(1, id, 0, 10_000);
    }
    d.finish(10);
    // 11 requests, all feasible at every size: the largest size with enough is 8.
    assert_eq!(d.last().0, 8);
    d.finish(50);
    assert_eq!(d.last().0, 2, "three left: a batch of 2");
    d.finish(70);
    assert_eq!(d.last().0, 1);
}

#[test]
fn orloj_keeps_a_request_only_in_the_queues_of_sizes_that_can_meet_its_deadline() {
    let mut d = orloj();
    d.arrive(0, 0, 1, 10_000);
    // Eight more, whose deadline a batch of 8 (2.4 x 50 ms at least) cannot meet but a
    // batch of 2 can, and four with all the time in the world.
    for id in 1..=8 {
        d.arrive(1, id, 1, 51 + 90);
    }
    for id in 9..=12 {
        d.arrive(1, id, 1, 10_000);
    }
    d.finish(50);
    let (size, requests) = d.last();
    assert!(
        size < 8,
        "the urgent requests fit no batch of 8: {size} {requests:?}"
    );
    assert!(
        requests.iter().all(|&r| (1..=8).contains(&r)),
        "{requests:?}"
    );
}

#[test]
fn orloj_prefers_a_request_likely_to_finish_at_little_cost() {
    // Same deadline; at batch size 1 the short application's request has the higher
    // Eq. 4.2 score (probability of finishing in time over expected batch time).
    let mut d = orloj();
    d.arrive(0, 0, 1, 10_000);
    // No batch of two can meet the deadline (60 ms at best for the long request, 60 ms
    // at the median with the mix for the short one).
    d.arrive(1, 1, 1, 105);
    d.arrive(1, 2, 0, 105);
    d.finish(50);
    assert_eq!(d.last(), (1, vec![2]));
}

#[test]
fn orloj_drops_requests_that_fit_no_batch_size() {
    let mut d = orloj();
    d.arrive(0, 0, 1, 10_000);
    d.arrive(1, 1, 1, 30);
    assert_eq!(
        d.dropped(),
        vec![(1, DropReason::Hopeless)],
        "hopeless on arrival"
    );
    d.arrive(2, 2, 1, 80);
    d.finish(50);
    assert_eq!(
        d.dropped()[1],
        (2, DropReason::Hopeless),
        "hopeless by the time it could run"
    );
}

#[test]
fn orloj_decides_the_same_across_a_rebase() {
    let events = |rebase: Duration| {
        let mut config = ServingConfig::default();
        config.orloj.rebase_after = rebase;
        let mut d = Drive::new(RequestSchedulerKind::Orloj, config);
        d.profile(0, &[10, 12, 14, 30]);
        d.profile(1, &[40, 45, 60]);
        let mut at = 0;
        for id in 0..400u64 {
            at += 7 + id % 5;
            d.arrive(at, id, (id % 3 == 0) as u32, at + 150 + (id % 7) * 20);
            if let Some((b, started)) = &d.running
                && ms(at) >= *started + ms(12 * b.batch_size as u64)
            {
                d.finish(at);
            }
        }
        (d.batches, d.drops)
    };
    assert_eq!(events(ms(250)), events(Duration::from_secs(1000)));
}

#[test]
fn errors_leave_the_state_unchanged() {
    for kind in RequestSchedulerKind::ALL {
        let mut d = drive(kind);
        d.profile(0, &[10]);
        d.arrive(5, 1, 0, 100);
        let again = Request {
            id: RequestId(1),
            app: AppId(0),
            arrival: ms(6),
            deadline: ms(100),
        };
        assert_eq!(
            d.s.handle(ms(6), RequestEvent::Arrived(again)),
            Err(ServingError::DuplicateRequest(RequestId(1)))
        );
        let wrong = RequestEvent::BatchFinished {
            batch: BatchId(7),
            duration: ms(1),
        };
        assert_eq!(
            d.s.handle(ms(6), wrong),
            Err(ServingError::UnknownBatch(BatchId(7)))
        );
        assert!(matches!(
            d.s.handle(ms(1), RequestEvent::Tick),
            Err(ServingError::TimeWentBackwards { .. })
        ));
        assert!(d.s.poll().is_empty(), "{kind}");
        d.finish(15);
        assert_eq!(d.s.pending(), 0, "{kind}");
    }
}

#[test]
fn configurations_that_cannot_work_are_refused() {
    let bad = |f: fn(&mut ServingConfig)| {
        let mut c = ServingConfig::default();
        f(&mut c);
        RequestSchedulerKind::Orloj.build(c).err()
    };
    assert!(bad(|c| c.batch_sizes = vec![]).is_some());
    assert!(bad(|c| c.batch_sizes = vec![4, 2]).is_some());
    assert!(bad(|c| c.batch_sizes = vec![0, 1]).is_some());
    assert!(bad(|c| c.orloj.b = 0.0).is_some());
    assert!(bad(|c| c.orloj.feasibility_quantile = 1.5).is_some());
    assert!(bad(|_| ()).is_none());
    assert_eq!(
        "Orloj".parse::<RequestSchedulerKind>(),
        Ok(RequestSchedulerKind::Orloj)
    );
    assert!("clock".parse::<RequestSchedulerKind>().is_err());
}

#[derive(Debug, Clone)]
enum Op {
    Arrive { app: u32, slack: u64 },
    Finish { took: u64 },
    Profile { app: u32, solo: u64 },
    Wait(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u32..3, 0u64..400).prop_map(|(app, slack)| Op::Arrive { app, slack }),
        4 => (1u64..120).prop_map(|took| Op::Finish { took }),
        2 => (0u32..3, 1u64..80).prop_map(|(app, solo)| Op::Profile { app, solo }),
        2 => (0u64..50).prop_map(Op::Wait),
    ]
}

fn kind() -> impl Strategy<Value = RequestSchedulerKind> {
    prop::sample::select(RequestSchedulerKind::ALL.to_vec())
}

/// Every scheduler's promises, checked after every event: one batch at a time, at a
/// supported size holding its requests; only pending requests run or are dropped, each
/// once; timers only in the future; and once the events stop and the worker keeps
/// finishing batches, every request is run or dropped, by the scheduler's own timers.
fn check_promises(kind: RequestSchedulerKind, ops: Vec<Op>) {
    let config = ServingConfig::default();
    let mut s = kind.build(config.clone()).unwrap();
    let mut now = Duration::ZERO;
    let mut next_id = 0;
    let mut pending: BTreeSet<RequestId> = BTreeSet::new();
    let mut resolved: BTreeSet<RequestId> = BTreeSet::new();
    let mut running: Option<(BatchId, Duration)> = None;
    let mut next_batch = 0;
    let mut apply = |s: &mut Box<dyn RequestScheduler>,
                     now: Duration,
                     event: RequestEvent,
                     running: &mut Option<(BatchId, Duration)>,
                     pending: &mut BTreeSet<RequestId>| {
        s.handle(now, event).unwrap();
        for action in s.poll() {
            match action {
                RequestAction::RunBatch(b) => {
                    assert!(running.is_none(), "{kind}: two batches at once");
                    assert_eq!(b.id, BatchId(next_batch), "{kind}");
                    next_batch += 1;
                    assert!(config.batch_sizes.contains(&b.batch_size), "{kind}");
                    assert!(!b.requests.is_empty() && b.requests.len() <= b.batch_size);
                    for r in &b.requests {
                        assert!(pending.remove(r), "{kind}: {r} ran but was not pending");
                        assert!(resolved.insert(*r));
                    }
                    *running = Some((b.id, now));
                }
                RequestAction::Drop { request, .. } => {
                    assert!(pending.remove(&request), "{kind}: {request} dropped twice");
                    assert!(resolved.insert(request));
                }
            }
        }
        assert_eq!(s.pending(), pending.len(), "{kind}");
        if let Some(t) = s.poll_timeout() {
            assert!(t > now, "{kind}: timer at {t:?} is not after {now:?}");
        }
    };
    for op in ops {
        let event = match op {
            Op::Arrive { app, slack } => {
                let id = RequestId(next_id);
                next_id += 1;
                pending.insert(id);
                RequestEvent::Arrived(Request {
                    id,
                    app: AppId(app),
                    arrival: now,
                    deadline: now + ms(slack),
                })
            }
            Op::Finish { took } => match running.take() {
                Some((batch, started)) => {
                    now = now.max(started + ms(took));
                    RequestEvent::BatchFinished {
                        batch,
                        duration: now - started,
                    }
                }
                None => RequestEvent::Tick,
            },
            Op::Profile { app, solo } => RequestEvent::Profiled {
                app: AppId(app),
                execution: ms(solo),
            },
            Op::Wait(t) => {
                now += ms(t);
                RequestEvent::Tick
            }
        };
        apply(&mut s, now, event, &mut running, &mut pending);
    }
    // Drain: the worker finishes each batch after 10 ms; timers fire.
    for _ in 0..10_000 {
        if pending.is_empty() {
            break;
        }
        let event = if let Some((batch, started)) = running.take() {
            now = now.max(started + ms(10));
            RequestEvent::BatchFinished {
                batch,
                duration: now - started,
            }
        } else {
            // Nothing else will happen: a scheduler holding requests must ask to be woken
            // (a daemon's last request of a burst would otherwise wait forever).
            now = s.poll_timeout().unwrap_or_else(|| {
                panic!(
                    "{kind}: {} requests pending, the worker idle and no timer",
                    pending.len()
                )
            });
            RequestEvent::Tick
        };
        apply(&mut s, now, event, &mut running, &mut pending);
    }
    assert!(
        pending.is_empty(),
        "{kind}: {} requests never resolved",
        pending.len()
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn every_scheduler_keeps_its_promises(kind in kind(), ops in prop::collection::vec(op(), 1..120)) {
        check_promises(kind, ops);
    }
}
