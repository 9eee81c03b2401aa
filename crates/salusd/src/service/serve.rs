//! `Serve` and `Infer`: served models' messages in, the serving layer's answers and
//! errors out.

use std::time::{Duration, Instant};

use salus_core::serving::RequestSchedulerKind;
use salus_proto::v1 as pb;
use tonic::{Code, Status};

use super::convert::{bounded_message, code};
use crate::auth::Principal;
use crate::engine::{Command, Engine};
use crate::serving::{DecodeSpec, InferRequest, ServeError, ServeSpec, Servers, VariantSpec};

impl From<ServeError> for Status {
    fn from(error: ServeError) -> Status {
        let code = match &error {
            ServeError::Spec { .. } | ServeError::Request { .. } => Code::InvalidArgument,
            ServeError::NotServed(_) => Code::FailedPrecondition,
            ServeError::AlreadyServed(_) => Code::AlreadyExists,
            ServeError::Dropped { .. } => Code::DeadlineExceeded,
            ServeError::Engine(e) => code(e),
        };
        Status::new(code, bounded_message(&error.to_string()))
    }
}

/// A duration from milliseconds a client gave: `None` for 0.
fn millis(what: &str, ms: f64) -> Result<Option<Duration>, Status> {
    if !(0.0..1e12).contains(&ms) {
        return Err(Status::invalid_argument(format!(
            "{what} must be a finite, non-negative number of milliseconds, not {ms}"
        )));
    }
    Ok((ms > 0.0).then(|| Duration::from_secs_f64(ms / 1e3)))
}

fn spec(request: &pb::ServeRequest) -> Result<ServeSpec, Status> {
    let scheduler = if request.scheduler.is_empty() {
        RequestSchedulerKind::Orloj
    } else {
        request
            .scheduler
            .parse()
            .map_err(|e: String| Status::invalid_argument(e))?
    };
    let variants = request
        .variants
        .iter()
        .map(|v| VariantSpec {
            name: v.name.clone(),
            programs: v
                .programs
                .iter()
                .map(|p| (p.batch_size as usize, p.program))
                .collect(),
        })
        .collect();
    let decode = request.decode.as_ref().map(|d| DecodeSpec {
        carry: d
            .carry
            .iter()
            .map(|c| (c.fetch as usize, c.feed as usize))
            .collect(),
        done: d.done as usize,
        max_steps: d.max_steps,
    });
    Ok(ServeSpec {
        scheduler,
        variants,
        decode,
        default_slo: millis("default_slo_ms", request.default_slo_ms)?,
        variant_feed: request.variant_feed.map(|f| f as usize),
    })
}

pub(super) async fn serve(
    engine: &Engine,
    servers: &Servers,
    principal: Principal,
    request: pb::ServeRequest,
) -> Result<pb::ServeResponse, Status> {
    let spec = spec(&request)?;
    let session = request.session;
    let slo_hint = engine
        .ask(Command::Sessions)
        .await?
        .into_iter()
        .find(|s| s.id.0 == session)
        .and_then(|s| s.slo);
    let calibration = servers
        .serve(engine, principal, session, spec, slo_hint)
        .await?;
    Ok(pb::ServeResponse {
        calibration: calibration
            .into_iter()
            .map(|(variant, batch_size, time)| pb::ProgramTime {
                variant: variant as u32,
                batch_size: batch_size as u32,
                ms: time.as_secs_f64() * 1e3,
            })
            .collect(),
    })
}

pub(super) async fn infer(
    servers: &Servers,
    principal: Principal,
    request: pb::InferRequest,
    arrived: Instant,
) -> Result<pb::InferResponse, Status> {
    let slo = millis("slo_ms", request.slo_ms)?;
    let answer = servers
        .infer(
            principal,
            request.session,
            InferRequest {
                feeds: request.feeds,
                variant: request.variant as usize,
                slo,
                app: request.app,
                arrived,
            },
        )
        .await?;
    let micros = |d: Duration| d.as_micros().min(u64::MAX as u128) as u64;
    Ok(pb::InferResponse {
        fetches: answer.fetches,
        latency_us: micros(answer.latency),
        queue_us: micros(answer.queued),
        batch_size: answer.batch_size as u32,
        batch_requests: answer.batch_requests as u32,
        batch_variant: answer.batch_variant as u32,
        steps: answer.steps,
        done: answer.done,
        met_deadline: answer.met_deadline,
    })
}
