//! Served models on a real salusd: requests batched by the daemon, decoding until each
//! request says stop, variants, drops and refusals.

#![allow(clippy::unwrap_used)]

mod common;

use common::{Daemon, bytes, floats, values};
use salus_client::{Client, Error, OpenOptions, Session, v1 as pb};
use salus_graph::samples::countdown;
use salus_graph::{DType, Graph, Op, Role, Tensor, TensorType};

const WIDTH: u64 = 8;
const LAYERS: usize = 2;

fn weights() -> Vec<Vec<f32>> {
    (0..LAYERS)
        .map(|l| values(100 + l as u64, (WIDTH * WIDTH) as usize))
        .collect()
}

/// `h` after `steps` steps of `used` layers, in f64.
fn reference(h: &[f32], steps: u32, used: usize) -> Vec<f64> {
    let w = weights();
    let d = WIDTH as usize;
    let mut h: Vec<f64> = h.iter().map(|&v| v as f64).collect();
    for _ in 0..steps {
        for w in &w[..used] {
            h = (0..d)
                .map(|c| {
                    (0..d)
                        .map(|j| h[j] * w[j * d + c] as f64)
                        .sum::<f64>()
                        .tanh()
                })
                .collect();
        }
    }
    h
}

/// An inference session of `countdown` with a program per batch size in `sizes` for each
/// variant (`used` layers 1..=variants); the largest batch of the last variant opens it.
async fn open(
    client: &Client,
    sizes: &[u64],
    variants: usize,
) -> (Session, Vec<pb::ServedVariant>) {
    let largest = *sizes.iter().max().unwrap();
    let initial = weights()
        .iter()
        .enumerate()
        .map(|(l, w)| (l as u32, bytes(w)))
        .collect();
    let session = client
        .open(OpenOptions {
            graph: countdown(largest, WIDTH, LAYERS, variants).to_proto(),
            kind: pb::SessionKind::Inference,
            hints: pb::Hints {
                name: "countdown".into(),
                ..Default::default()
            },
            initial,
        })
        .await
        .unwrap();
    let mut served = Vec::new();
    for used in 1..=variants {
        let mut programs = Vec::new();
        for &size in sizes {
            let program = if size == largest && used == variants {
                0
            } else {
                session
                    .add_program(countdown(size, WIDTH, LAYERS, used).to_proto())
                    .await
                    .unwrap()
                    .program
            };
            programs.push(pb::BatchProgram {
                batch_size: size as u32,
                program,
            });
        }
        served.push(pb::ServedVariant {
            name: format!("{used} layers"),
            programs,
        });
    }
    (session, served)
}

fn decode(max_steps: u32) -> pb::Decode {
    pb::Decode {
        carry: vec![
            pb::Carry { fetch: 0, feed: 0 },
            pb::Carry { fetch: 1, feed: 1 },
        ],
        done: 2,
        max_steps,
    }
}

fn request(session: u64, seed: u64, left: f32, variant: u32) -> (Vec<f32>, pb::InferRequest) {
    let h = values(seed, WIDTH as usize);
    let request = pb::InferRequest {
        session,
        feeds: vec![bytes(&h), bytes(&[left])],
        variant,
        ..Default::default()
    };
    (h, request)
}

fn close_to(got: &[f32], want: &[f64], what: &str) {
    // Each step is a width-8 f32 dot product and a tanh: a few f32 roundings per element,
    // contracted by tanh, so 1e-5 bounds many steps' worth of them.
    for (g, w) in got.iter().zip(want) {
        assert!(
            (*g as f64 - w).abs() < 1e-5,
            "{what}: {got:?} against {want:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decoding_requests_take_their_own_steps_and_are_answered_alone() {
    let daemon = Daemon::start(&["--memory", "64MiB"]);
    let client = daemon.client().await;
    let (session, variants) = open(&client, &[1, 2, 4], 1).await;
    let served = session
        .serve(pb::ServeRequest {
            scheduler: "edf".into(),
            variants,
            decode: Some(decode(4000)),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(served.calibration.len(), 3, "{served:?}");
    // A long request first: the others arrive while its batch runs (3,000 steps, tens of
    // milliseconds on any machine), so they queue and run batched once it is done.
    let (_, first) = request(session.id, 1000, 3000.0, 0);
    let long = tokio::spawn({
        let client = client.clone();
        async move { client.infer(first).await }
    });
    let mut asked = Vec::new();
    for i in 0..12u64 {
        let (h, request) = request(session.id, i, (i % 6 + 1) as f32, 0);
        let client = client.clone();
        asked.push((
            h,
            i % 6 + 1,
            tokio::spawn(async move { client.infer(request).await }),
        ));
    }
    let mut batched = 0;
    for (h, left, answer) in asked {
        let answer = answer.await.unwrap().unwrap();
        assert_eq!((answer.steps, answer.done), (left as u32, true));
        assert_eq!(
            floats(&answer.fetches[1]),
            vec![0.0],
            "left counted down to 0"
        );
        assert_eq!(answer.fetches[2], vec![1], "done");
        close_to(
            &floats(&answer.fetches[0]),
            &reference(&h, left as u32, 1),
            "h",
        );
        assert!(answer.batch_requests as u32 <= answer.batch_size);
        batched += (answer.batch_requests > 1) as u32;
        assert!(answer.met_deadline, "no SLO: no deadline to miss");
    }
    assert!(
        batched > 0,
        "12 requests queued behind a long one ran one at a time"
    );
    let long = long.await.unwrap().unwrap();
    assert_eq!((long.steps, long.done), (3000, true));

    // A request not done within max_steps is answered with its last step, not done.
    let (session2, variants) = open(&client, &[1, 2], 1).await;
    session2
        .serve(pb::ServeRequest {
            scheduler: "fifo".into(),
            variants,
            decode: Some(decode(5)),
            ..Default::default()
        })
        .await
        .unwrap();
    let (h, slow) = request(session2.id, 99, 100.0, 0);
    let answer = client.infer(slow).await.unwrap();
    assert_eq!((answer.steps, answer.done), (5, false));
    assert_eq!(floats(&answer.fetches[1]), vec![95.0]);
    close_to(
        &floats(&answer.fetches[0]),
        &reference(&h, 5, 1),
        "h after 5 steps",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_runs_its_costliest_variant_and_cuts_rows_back() {
    let metrics = common::free_address();
    let daemon = Daemon::start(&["--memory", "64MiB", "--metrics", &metrics]);
    let client = daemon.client().await;
    let (session, variants) = open(&client, &[1, 4], 2).await;
    session
        .serve(pb::ServeRequest {
            scheduler: "orloj".into(),
            variants,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut asked = Vec::new();
    for i in 0..10u64 {
        let (h, request) = request(session.id, 50 + i, 3.0, (i % 2) as u32);
        let client = client.clone();
        asked.push((h, tokio::spawn(async move { client.infer(request).await })));
    }
    for (h, answer) in asked {
        let answer = answer.await.unwrap().unwrap();
        let layers = answer.batch_variant as usize + 1;
        close_to(&floats(&answer.fetches[0]), &reference(&h, 1, layers), "h");
        assert_eq!(floats(&answer.fetches[1]), vec![2.0]);
        assert_eq!(answer.steps, 1);
    }
    // What salusctl and the metrics endpoint show of it.
    let info = client
        .list_sessions()
        .await
        .unwrap()
        .into_iter()
        .find(|s| s.id == session.id)
        .and_then(|s| s.serving)
        .unwrap();
    assert_eq!(
        (info.scheduler.as_str(), info.finished, info.pending),
        ("orloj", 10, 0)
    );
    // Ten requests in batches of at most 4.
    let batches: u64 = info.batches.values().sum();
    assert!((3..=10).contains(&batches), "{info:?}");
    assert!(info.p99_latency_ms >= info.p50_latency_ms && info.p50_latency_ms > 0.0);
    let body = common::scrape(metrics).await;
    let finished = format!(
        "salus_serving_requests_total{{session=\"{}\",outcome=\"finished\"}} 10",
        session.id
    );
    assert!(body.contains(&finished), "{body}");
}

fn status(error: Error) -> tonic::Status {
    match error {
        Error::Status(status) => status,
        other => panic!("not a status: {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_serving_requests_are_refused_by_name_and_others_go_on() {
    let daemon = Daemon::start(&["--memory", "64MiB"]);
    let client = daemon.client().await;
    let (session, variants) = open(&client, &[1, 2], 1).await;
    let (_, early) = request(session.id, 1, 2.0, 0);
    let refused = status(client.infer(early).await.unwrap_err());
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    assert!(refused.message().contains("not served"), "{refused:?}");

    // A variant naming a program the session lacks; a done flag that is not a fetch.
    let mut wrong = variants.clone();
    wrong[0].programs[0].program = 9;
    let refused = status(
        session
            .serve(pb::ServeRequest {
                variants: wrong,
                ..Default::default()
            })
            .await
            .unwrap_err(),
    );
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert!(refused.message().contains("no program 9"), "{refused:?}");
    let mut no_flag = decode(5);
    no_flag.done = 7;
    let refused = status(
        session
            .serve(pb::ServeRequest {
                variants: variants.clone(),
                decode: Some(no_flag),
                ..Default::default()
            })
            .await
            .unwrap_err(),
    );
    assert!(
        refused.message().contains("done flag is fetch 7"),
        "{refused:?}"
    );
    let refused = status(
        session
            .serve(pb::ServeRequest {
                variants: variants.clone(),
                scheduler: "lottery".into(),
                ..Default::default()
            })
            .await
            .unwrap_err(),
    );
    assert!(
        refused.message().contains("unknown request scheduler"),
        "{refused:?}"
    );

    session
        .serve(pb::ServeRequest {
            variants: variants.clone(),
            decode: Some(decode(8)),
            ..Default::default()
        })
        .await
        .unwrap();
    let again = status(
        session
            .serve(pb::ServeRequest {
                variants,
                ..Default::default()
            })
            .await
            .unwrap_err(),
    );
    assert_eq!(again.code(), tonic::Code::AlreadyExists);

    // A row of the wrong size, and an unknown variant: refused, named; a good request
    // beside them is answered.
    let (_, mut short) = request(session.id, 2, 2.0, 0);
    short.feeds[0].pop();
    let (_, mut unknown) = request(session.id, 3, 2.0, 0);
    unknown.variant = 3;
    let (h, good) = request(session.id, 4, 2.0, 0);
    let (short, unknown, good) = tokio::join!(
        client.infer(short),
        client.infer(unknown),
        client.infer(good)
    );
    let short = status(short.unwrap_err());
    assert_eq!(short.code(), tonic::Code::InvalidArgument);
    assert!(short.message().contains("feed 0 has 31 bytes"), "{short:?}");
    let unknown = status(unknown.unwrap_err());
    assert!(
        unknown.message().contains("variant 3 does not exist"),
        "{unknown:?}"
    );
    let good = good.unwrap();
    close_to(&floats(&good.fetches[0]), &reference(&h, 2, 1), "h");

    // A request whose deadline cannot be met is dropped or answered late, never on time.
    let (_, mut hurried) = request(session.id, 5, 40.0, 0);
    hurried.slo_ms = 0.001;
    match client.infer(hurried).await {
        Ok(answer) => assert!(!answer.met_deadline),
        Err(e) => assert_eq!(status(e).code(), tonic::Code::DeadlineExceeded),
    }

    // Closing the session ends serving.
    let id = session.id;
    session.close().await.unwrap();
    let (_, after) = request(id, 6, 2.0, 0);
    let refused = status(client.infer(after).await.unwrap_err());
    assert_eq!(
        refused.code(),
        tonic::Code::FailedPrecondition,
        "{refused:?}"
    );
}

/// `rows = embedding(table, ids)` for a batch of `batch` ids: an id outside the table's 4
/// rows fails the iteration.
fn lookup(batch: u64) -> Graph {
    let tensor = |name: &str, dtype, shape: &[u64], role| Tensor {
        name: name.into(),
        ty: TensorType::new(dtype, shape.to_vec()),
        role,
        data: vec![],
    };
    common::one_node_graph(
        vec![
            tensor("table", DType::F32, &[4, 2], Role::Parameter),
            tensor("ids", DType::I64, &[batch], Role::Feed),
            tensor("rows", DType::F32, &[batch, 2], Role::Intermediate),
        ],
        "lookup",
        Op::Embedding,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_values_fail_its_batch_fails_alone() {
    let daemon = Daemon::start(&["--memory", "64MiB"]);
    let client = daemon.client().await;
    let table: Vec<f32> = (0..8).map(|v| v as f32).collect();
    let session = client
        .open(OpenOptions {
            graph: lookup(8).to_proto(),
            kind: pb::SessionKind::Inference,
            hints: pb::Hints::default(),
            initial: vec![(0, bytes(&table))],
        })
        .await
        .unwrap();
    let one = session
        .add_program(lookup(1).to_proto())
        .await
        .unwrap()
        .program;
    session
        .serve(pb::ServeRequest {
            scheduler: "fifo".into(),
            variants: vec![pb::ServedVariant {
                name: "lookup".into(),
                programs: vec![
                    pb::BatchProgram {
                        batch_size: 1,
                        program: one,
                    },
                    pb::BatchProgram {
                        batch_size: 8,
                        program: 0,
                    },
                ],
            }],
            ..Default::default()
        })
        .await
        .unwrap();
    // Sent together, so that some share a batch with the bad one (id 9) whenever the
    // worker is busy as they arrive; whatever the batches, only the bad one fails.
    let ids = [0i64, 3, 9, 1, 2, 3, 0, 1];
    let answers = futures_join(&client, session.id, &ids).await;
    for (&id, answer) in ids.iter().zip(answers) {
        match answer {
            Ok(a) => {
                assert!(id < 4, "id {id} answered");
                assert_eq!(
                    floats(&a.fetches[0]),
                    vec![2.0 * id as f32, 2.0 * id as f32 + 1.0]
                );
            }
            Err(e) => {
                assert_eq!(id, 9, "id {id} failed: {e}");
                let status = status(e);
                assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status:?}");
            }
        }
    }
}

async fn futures_join(
    client: &Client,
    session: u64,
    ids: &[i64],
) -> Vec<Result<pb::InferResponse, Error>> {
    let calls = ids.iter().map(|&id| {
        let client = client.clone();
        async move {
            client
                .infer(pb::InferRequest {
                    session,
                    feeds: vec![id.to_le_bytes().to_vec()],
                    ..Default::default()
                })
                .await
        }
    });
    let handles: Vec<_> = calls.map(tokio::spawn).collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.unwrap());
    }
    out
}
