//! Replays inference requests through a `salus-core` request scheduler in virtual time,
//! on one worker.
//!
//! The worker runs one batch at a time; a batch of size `k` whose slowest request takes
//! `l` alone runs for the cost model's time (`BatchCost::batch_time(k, l)`, Eq. 4.3 with
//! Eq. 4.4's padding to the longest). When a batch finishes the driver tells the
//! scheduler, then profiles its requests: each one's solo time goes back as
//! `RequestEvent::Profiled` (the dissertation's profiler re-runs sampled finished requests
//! alone; here every executed request is sampled, none that was dropped). The scheduler
//! decides everything else.

use std::time::Duration;

use salus_core::serving::{
    AppId, BatchId, Request, RequestAction, RequestEvent, RequestId, RequestSchedulerKind,
    ServingConfig, ServingError,
};
use serde::Serialize;

/// One request of a trace.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RequestSpec {
    /// When it arrives.
    pub arrival: Duration,
    /// Its application.
    pub app: AppId,
    /// How long it takes run alone (unknown to the scheduler).
    pub solo: Duration,
}

/// What became of a trace's requests under one scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ServingReport {
    /// Requests in the trace.
    pub requests: usize,
    /// Finished by their deadline.
    pub in_time: usize,
    /// Ran but finished after their deadline.
    pub late: usize,
    /// Dropped without running.
    pub dropped: usize,
    /// Batches run.
    pub batches: usize,
    /// Requests per batch, on average.
    pub mean_batch: f64,
    /// Fraction of the run the worker was busy.
    pub utilisation: f64,
}

impl ServingReport {
    /// Requests finished in time over all requests (the dissertation's finish rate).
    pub fn finish_rate(&self) -> f64 {
        if self.requests == 0 {
            return 1.0;
        }
        self.in_time as f64 / self.requests as f64
    }
}

struct Running {
    id: BatchId,
    ends: Duration,
    took: Duration,
    members: Vec<usize>,
}

/// Replays `requests` (sorted by arrival) under `kind`, each with deadline `arrival +
/// slo`. `warmup` are solo times profiled before the first request (the offline profile
/// every serving system starts from).
pub fn serve(
    requests: &[RequestSpec],
    slo: Duration,
    kind: RequestSchedulerKind,
    config: &ServingConfig,
    warmup: &[(AppId, Duration)],
) -> Result<ServingReport, ServingError> {
    let mut scheduler = kind.build(config.clone())?;
    for &(app, execution) in warmup {
        scheduler.handle(Duration::ZERO, RequestEvent::Profiled { app, execution })?;
    }
    let mut report = ServingReport {
        requests: requests.len(),
        in_time: 0,
        late: 0,
        dropped: 0,
        batches: 0,
        mean_batch: 0.0,
        utilisation: 0.0,
    };
    let deadline = |i: usize| requests[i].arrival + slo;
    let mut next = 0;
    let mut running: Option<Running> = None;
    let mut busy = Duration::ZERO;
    let mut now = Duration::ZERO;
    loop {
        let times = [
            running.as_ref().map(|r| r.ends),
            requests.get(next).map(|r| r.arrival),
            scheduler.poll_timeout(),
        ];
        let Some(at) = times.into_iter().flatten().min() else {
            break;
        };
        now = at.max(now);
        // At equal times: the worker's news first, then arrivals, then the timer.
        if running.as_ref().is_some_and(|r| r.ends <= now) {
            if let Some(done) = running.take() {
                scheduler.handle(
                    now,
                    RequestEvent::BatchFinished {
                        batch: done.id,
                        duration: done.took,
                    },
                )?;
                for &i in &done.members {
                    let (app, execution) = (requests[i].app, requests[i].solo);
                    scheduler.handle(now, RequestEvent::Profiled { app, execution })?;
                }
            }
        } else if requests.get(next).is_some_and(|r| r.arrival <= now) {
            let spec = requests[next];
            let request = Request {
                id: RequestId(next as u64),
                app: spec.app,
                arrival: spec.arrival,
                deadline: deadline(next),
            };
            next += 1;
            scheduler.handle(now, RequestEvent::Arrived(request))?;
        } else {
            scheduler.handle(now, RequestEvent::Tick)?;
        }
        for action in scheduler.poll() {
            match action {
                RequestAction::Drop { .. } => report.dropped += 1,
                RequestAction::RunBatch(batch) => {
                    let members: Vec<usize> = batch.requests.iter().map(|r| r.0 as usize).collect();
                    let slowest = members
                        .iter()
                        .map(|&i| requests[i].solo)
                        .max()
                        .unwrap_or_default();
                    let took = config.cost.batch_time(batch.batch_size, slowest);
                    let ends = now + took;
                    for &i in &members {
                        if ends <= deadline(i) {
                            report.in_time += 1;
                        } else {
                            report.late += 1;
                        }
                    }
                    report.batches += 1;
                    busy += took;
                    running = Some(Running {
                        id: batch.id,
                        ends,
                        took,
                        members,
                    });
                }
            }
        }
    }
    let executed = report.in_time + report.late;
    report.mean_batch = executed as f64 / report.batches.max(1) as f64;
    report.utilisation = busy.as_secs_f64() / now.as_secs_f64().max(1e-9);
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace(n: usize, gap_ms: u64, solo_ms: u64) -> Vec<RequestSpec> {
        (0..n)
            .map(|i| RequestSpec {
                arrival: Duration::from_millis(gap_ms * i as u64),
                app: AppId(0),
                solo: Duration::from_millis(solo_ms),
            })
            .collect()
    }

    #[test]
    fn every_request_is_accounted_for_under_every_scheduler() {
        let requests = trace(500, 2, 5);
        let warmup: Vec<(AppId, Duration)> = (0..50)
            .map(|_| (AppId(0), Duration::from_millis(5)))
            .collect();
        for kind in RequestSchedulerKind::ALL {
            let r = serve(
                &requests,
                Duration::from_millis(40),
                kind,
                &ServingConfig::default(),
                &warmup,
            )
            .unwrap();
            assert_eq!(r.in_time + r.late + r.dropped, r.requests, "{kind}: {r:?}");
            assert!(r.finish_rate() > 0.5, "{kind}: {r:?}");
        }
    }

    #[test]
    fn a_light_load_meets_every_deadline() {
        let requests = trace(200, 20, 5);
        for kind in RequestSchedulerKind::ALL {
            let r = serve(
                &requests,
                Duration::from_millis(15),
                kind,
                &ServingConfig::default(),
                &[(AppId(0), Duration::from_millis(5))],
            )
            .unwrap();
            assert_eq!(r.in_time, 200, "{kind}: {r:?}");
        }
    }
}
