use super::*;

const EXPLICIT: &str = r#"{"id":"j1","arrival_s":0.0,"iterations":1200,"iteration_s":0.21,"persistent_bytes":110900000,"ephemeral_bytes":3100000000,"compute_share":0.7}"#;
const FROM_CATALOG: &str =
    r#"{"id":"j2","arrival_s":1.5,"iterations":300,"model":"googlenet","batch_size":25}"#;

fn parse_err(text: &str) -> TraceError {
    match parse_trace(text) {
        Ok(jobs) => panic!("expected an error, parsed {jobs:?}"),
        Err(err) => err,
    }
}

fn parse_ok(text: &str) -> Vec<JobSpec> {
    parse_trace(text).unwrap_or_else(|err| panic!("unexpected error: {err}"))
}

/// The explicit example line with `field` set to the JSON text `value`.
fn explicit_with(field: &str, value: &str) -> String {
    let mut fields: Map<String, Value> =
        serde_json::from_str(EXPLICIT).unwrap_or_else(|err| panic!("{err}"));
    let value: Value = serde_json::from_str(value).unwrap_or_else(|err| panic!("{err}"));
    fields.insert(field.to_string(), value);
    Value::Object(fields).to_string()
}

fn explicit_without(field: &str) -> String {
    let mut fields: Map<String, Value> =
        serde_json::from_str(EXPLICIT).unwrap_or_else(|err| panic!("{err}"));
    fields.remove(field);
    Value::Object(fields).to_string()
}

fn assert_error(text: &str, line: usize, fragments: &[&str]) {
    let err = parse_err(text);
    assert_eq!(err.line, line, "{err}");
    for fragment in fragments {
        assert!(err.message.contains(fragment), "{err:?} lacks {fragment:?}");
    }
}

#[test]
fn parses_the_explicit_form() {
    let jobs = parse_ok(EXPLICIT);
    assert_eq!(
        jobs,
        vec![JobSpec {
            id: "j1".to_string(),
            arrival_s: 0.0,
            iterations: 1200,
            iteration_s: 0.21,
            persistent_bytes: 110_900_000,
            ephemeral_bytes: 3_100_000_000,
            compute_share: 0.7,
            workload: None,
        }]
    );
}

#[test]
fn parses_the_catalog_form() {
    let jobs = parse_ok(FROM_CATALOG);
    let googlenet = catalog::lookup("googlenet", "25").unwrap_or_else(|| panic!("catalog"));
    assert_eq!(
        jobs,
        vec![JobSpec {
            id: "j2".to_string(),
            arrival_s: 1.5,
            iterations: 300,
            iteration_s: googlenet.iteration_s,
            persistent_bytes: googlenet.persistent_bytes,
            ephemeral_bytes: googlenet.ephemeral_bytes,
            compute_share: googlenet.compute_share,
            workload: Some("googlenet_25".to_string()),
        }]
    );
}

#[test]
fn batch_size_may_be_an_integer_or_a_string() {
    let text = [
        r#"{"id":"a","arrival_s":0,"iterations":1,"model":"resnet50","batch_size":50}"#,
        r#"{"id":"b","arrival_s":0,"iterations":1,"model":"resnet50","batch_size":"50"}"#,
        r#"{"id":"c","arrival_s":0,"iterations":1,"model":"seq2seq","batch_size":"small"}"#,
    ]
    .join("\n");
    let jobs = parse_ok(&text);
    let names: Vec<Option<&str>> = jobs.iter().map(|j| j.workload.as_deref()).collect();
    assert_eq!(
        names,
        vec![
            Some("resnet50_50"),
            Some("resnet50_50"),
            Some("seq2seq_small")
        ]
    );
}

#[test]
fn integer_arrival_times_are_accepted() {
    let jobs = parse_ok(&explicit_with("arrival_s", "7"));
    assert_eq!(jobs[0].arrival_s, 7.0);
}

#[test]
fn keeps_file_order_and_skips_blank_lines() {
    let text = format!("\n{FROM_CATALOG}\n   \n\t\n{EXPLICIT}\r\n\n");
    let jobs = parse_ok(&text);
    let ids: Vec<&str> = jobs.iter().map(|job| job.id.as_str()).collect();
    assert_eq!(ids, vec!["j2", "j1"]);
}

#[test]
fn errors_report_the_line_counting_blank_lines() {
    let text = format!("{EXPLICIT}\n\n{{\"id\":");
    assert_error(&text, 3, &["malformed JSON"]);
}

#[test]
fn rejects_malformed_json() {
    assert_error("{\"id\":\"j1\",}", 1, &["malformed JSON"]);
    assert_error("not json", 1, &["malformed JSON"]);
    assert_error(&format!("{EXPLICIT} {EXPLICIT}"), 1, &["malformed JSON"]);
}

#[test]
fn rejects_lines_that_are_not_objects() {
    assert_error("[1, 2]", 1, &["expected a JSON object", "an array"]);
    assert_error("42", 1, &["expected a JSON object", "a number"]);
}

#[test]
fn rejects_unknown_fields_naming_them() {
    assert_error(
        &explicit_with("priority", "3"),
        1,
        &["unknown field \"priority\"", "either model and batch_size"],
    );
    // Field names are case-sensitive.
    assert_error(
        &explicit_with("Model", "\"x\""),
        1,
        &["unknown field \"Model\""],
    );
    let two = explicit_with("zeta", "1").replace('}', ",\"alpha\":[2]}");
    assert_error(&two, 1, &["unknown fields", "\"alpha\"", "\"zeta\""]);
}

#[test]
fn rejects_missing_fields_naming_them() {
    assert_error(
        &explicit_without("iterations"),
        1,
        &["missing field iterations"],
    );
    assert_error(&explicit_without("id"), 1, &["missing field id"]);
    assert_error(
        &explicit_without("compute_share"),
        1,
        &["missing field compute_share"],
    );
    assert_error(
        r#"{"id":"a","arrival_s":0,"iterations":1,"model":"vae"}"#,
        1,
        &["missing field batch_size"],
    );
    assert_error(
        r#"{"id":"a","arrival_s":0,"iterations":1,"batch_size":64}"#,
        1,
        &["missing field model"],
    );
    assert_error(
        r#"{"id":"a","iterations":1,"iteration_s":0.1}"#,
        1,
        &[
            "missing fields",
            "arrival_s",
            "persistent_bytes",
            "ephemeral_bytes",
            "compute_share",
        ],
    );
}

#[test]
fn a_job_needs_one_of_the_two_forms() {
    assert_error(
        r#"{"id":"a","arrival_s":0,"iterations":1}"#,
        1,
        &["missing fields", "model and batch_size", "iteration_s"],
    );
    assert_error(
        "{}",
        1,
        &["missing fields id, arrival_s, iterations", "either"],
    );
}

#[test]
fn rejects_mixing_catalog_and_explicit_fields() {
    let text = explicit_with("model", "\"googlenet\"");
    assert_error(
        &text,
        1,
        &["model", "iteration_s", "compute_share", "one form"],
    );
    let text = r#"{"id":"a","arrival_s":0,"iterations":1,"model":"vae","batch_size":64,"compute_share":0.5}"#;
    assert_error(
        text,
        1,
        &["(model, batch_size)", "(compute_share)", "one form"],
    );
}

#[test]
fn rejects_unknown_models_listing_the_catalog() {
    let text = r#"{"id":"a","arrival_s":0,"iterations":1,"model":"lenet","batch_size":25}"#;
    assert_error(
        text,
        1,
        &["\"model\"", "unknown model \"lenet\"", "googlenet"],
    );
}

#[test]
fn rejects_unknown_batch_sizes_listing_the_models_sizes() {
    let text = r#"{"id":"a","arrival_s":0,"iterations":1,"model":"googlenet","batch_size":30}"#;
    assert_error(
        text,
        1,
        &["\"batch_size\"", "no batch size \"30\"", "25, 50, 100"],
    );
    let text = r#"{"id":"a","arrival_s":0,"iterations":1,"model":"seq2seq","batch_size":"huge"}"#;
    assert_error(text, 1, &["small, medium, large"]);
    let text = r#"{"id":"a","arrival_s":0,"iterations":1,"model":"vae","batch_size":64.5}"#;
    assert_error(text, 1, &["\"batch_size\"", "64.5"]);
    let text = r#"{"id":"a","arrival_s":0,"iterations":1,"model":"vae","batch_size":null}"#;
    assert_error(text, 1, &["\"batch_size\"", "null"]);
}

#[test]
fn rejects_empty_ids() {
    assert_error(&explicit_with("id", "\"\""), 1, &["\"id\"", "empty"]);
}

#[test]
fn rejects_duplicate_ids_naming_the_earlier_line() {
    let text = format!(
        "{EXPLICIT}\n{FROM_CATALOG}\n\n{}",
        explicit_with("id", "\"j2\"")
    );
    assert_error(&text, 4, &["\"id\"", "\"j2\"", "line 2"]);
}

#[test]
fn rejects_bad_arrival_times() {
    assert_error(
        &explicit_with("arrival_s", "-0.5"),
        1,
        &["\"arrival_s\"", "-0.5"],
    );
    assert_error(
        &explicit_with("arrival_s", "\"soon\""),
        1,
        &["\"arrival_s\"", "number"],
    );
    // JSON has no infinities: an overflowing literal is refused, never taken as one.
    let overflowing = EXPLICIT.replace("\"arrival_s\":0.0", "\"arrival_s\":1e400");
    assert_eq!(parse_err(&overflowing).line, 1);
}

#[test]
fn rejects_zero_or_non_integer_iterations() {
    assert_error(
        &explicit_with("iterations", "0"),
        1,
        &["\"iterations\"", "at least 1"],
    );
    assert_error(
        &explicit_with("iterations", "1.5"),
        1,
        &["\"iterations\"", "integer"],
    );
    assert_error(
        &explicit_with("iterations", "-3"),
        1,
        &["\"iterations\"", "integer"],
    );
}

#[test]
fn rejects_bad_iteration_times() {
    assert_error(
        &explicit_with("iteration_s", "0"),
        1,
        &["\"iteration_s\"", "> 0"],
    );
    assert_error(&explicit_with("iteration_s", "-1"), 1, &["\"iteration_s\""]);
    assert_error(
        &explicit_with("iteration_s", "null"),
        1,
        &["\"iteration_s\"", "null"],
    );
}

#[test]
fn rejects_compute_shares_outside_zero_to_one() {
    for bad in ["0", "0.0", "-0.2", "1.01", "2"] {
        assert_error(
            &explicit_with("compute_share", bad),
            1,
            &["\"compute_share\"", "(0, 1]"],
        );
    }
    assert_eq!(
        parse_ok(&explicit_with("compute_share", "1"))[0].compute_share,
        1.0
    );
}

#[test]
fn rejects_zero_ephemeral_memory_and_bad_byte_counts() {
    assert_error(
        &explicit_with("ephemeral_bytes", "0"),
        1,
        &["\"ephemeral_bytes\""],
    );
    assert_error(
        &explicit_with("persistent_bytes", "1.5e8"),
        1,
        &["\"persistent_bytes\"", "integer"],
    );
    assert_error(
        &explicit_with("ephemeral_bytes", "-5"),
        1,
        &["\"ephemeral_bytes\"", "integer"],
    );
    assert_eq!(
        parse_ok(&explicit_with("persistent_bytes", "0"))[0].persistent_bytes,
        0
    );
}

#[test]
fn non_finite_figures_are_written_as_null_and_refused_on_reading() {
    let job = JobSpec {
        arrival_s: f64::NAN,
        ..parse_ok(EXPLICIT).remove(0)
    };
    let line = job.to_json_line();
    assert!(line.contains("\"arrival_s\":null"), "{line}");
    assert_error(
        &line,
        1,
        &["\"arrival_s\"", "expected a number, found null"],
    );
}

#[test]
fn rejects_traces_without_jobs() {
    for text in ["", "\n\n", "  \n\t\n"] {
        let err = parse_err(text);
        assert_eq!(err.line, 0);
        assert_eq!(err.message, "trace has no jobs");
        assert_eq!(err.to_string(), "line 0: trace has no jobs");
    }
}

#[test]
fn error_display_names_the_line() {
    let err = parse_err(&format!("{EXPLICIT}\n{}", explicit_with("iterations", "0")));
    assert_eq!(err.to_string(), format!("line 2: {}", err.message));
}

#[test]
fn round_trips_every_catalog_workload() {
    for (index, workload) in catalog::catalog().iter().enumerate() {
        let job = JobSpec {
            id: format!("job-{index}"),
            arrival_s: index as f64 * 0.37,
            iterations: 10 + index as u64,
            iteration_s: workload.iteration_s,
            persistent_bytes: workload.persistent_bytes,
            ephemeral_bytes: workload.ephemeral_bytes,
            compute_share: workload.compute_share,
            workload: Some(workload.name()),
        };
        let line = job.to_json_line();
        assert!(line.contains("\"model\""), "{line}");
        assert!(!line.contains("iteration_s"), "{line}");
        assert_eq!(parse_ok(&line), vec![job]);
    }
}

#[test]
fn catalog_lines_write_numeric_batches_as_integers() {
    let job = &parse_ok(FROM_CATALOG)[0];
    assert_eq!(
        job.to_json_line(),
        r#"{"id":"j2","arrival_s":1.5,"iterations":300,"model":"googlenet","batch_size":25}"#
    );
    let seq = r#"{"id":"s","arrival_s":0,"iterations":1,"model":"seq2seq","batch_size":"large"}"#;
    assert!(
        parse_ok(seq)[0]
            .to_json_line()
            .contains(r#""batch_size":"large""#)
    );
}

#[test]
fn round_trips_explicit_jobs_exactly() {
    let job = JobSpec {
        id: "odd \"id\" \\ with ünïcode".to_string(),
        arrival_s: 0.1 + 0.2,
        iterations: u64::MAX,
        iteration_s: 1.0 / 3.0,
        persistent_bytes: u64::MAX,
        ephemeral_bytes: 1,
        compute_share: f64::MIN_POSITIVE,
        workload: None,
    };
    assert_eq!(parse_ok(&job.to_json_line()), vec![job.clone()]);
    assert_eq!(
        parse_ok(&parse_ok(EXPLICIT)[0].to_json_line()),
        parse_ok(EXPLICIT)
    );
}

#[test]
fn round_trips_arbitrary_floats_bit_for_bit() {
    // A fixed xorshift sequence: arrival times and durations with all 53 bits in use,
    // which a lossy decimal conversion would get wrong about one time in seven.
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 11) as f64 / (1u64 << 53) as f64
    };
    for index in 0..2000 {
        let job = JobSpec {
            id: format!("j{index}"),
            arrival_s: next() * 1.0e5,
            iterations: 1,
            iteration_s: next() + f64::EPSILON,
            persistent_bytes: 0,
            ephemeral_bytes: 1,
            compute_share: next().max(f64::EPSILON),
            workload: None,
        };
        let back = parse_ok(&job.to_json_line()).remove(0);
        assert_eq!(back.arrival_s.to_bits(), job.arrival_s.to_bits(), "{job:?}");
        assert_eq!(
            back.iteration_s.to_bits(),
            job.iteration_s.to_bits(),
            "{job:?}"
        );
        assert_eq!(
            back.compute_share.to_bits(),
            job.compute_share.to_bits(),
            "{job:?}"
        );
    }
}

#[test]
fn numbers_are_read_as_the_nearest_float() {
    // Written into the line as text: going through a serde_json value would round first.
    let text = EXPLICIT
        .replace("\"arrival_s\":0.0", "\"arrival_s\":985.6906946328695")
        .replace(
            "\"iteration_s\":0.21",
            "\"iteration_s\":2.2201838057111728e-13",
        );
    let job = parse_ok(&text).remove(0);
    assert_eq!(job.arrival_s, 985.690_694_632_869_5);
    assert_eq!(job.iteration_s, 2.220_183_805_711_172_8e-13);
}

#[test]
fn member_texts_follow_the_object_structure() {
    let line = r#" { "a" : 1.5e3 , "b":"x,\"}y", "c":[1,{"d":2}],"\u0065":-0.25,"a":7}"#;
    let texts = member_texts(line);
    assert_eq!(texts.get("a"), Some(&"7"));
    assert_eq!(texts.get("b"), Some(&r#""x,\"}y""#));
    assert_eq!(texts.get("c"), Some(&r#"[1,{"d":2}]"#));
    assert_eq!(texts.get("e"), Some(&"-0.25"));
    assert_eq!(texts.len(), 4);
}

#[test]
fn changed_figures_are_written_explicitly() {
    let mut job = parse_ok(FROM_CATALOG).remove(0);
    job.iteration_s *= 2.0;
    let line = job.to_json_line();
    assert!(line.contains("\"iteration_s\""), "{line}");
    let back = parse_ok(&line).remove(0);
    assert_eq!(back.workload, None);
    assert_eq!(
        JobSpec {
            workload: None,
            ..job
        },
        back
    );
}

#[test]
fn unknown_workload_names_are_written_explicitly() {
    let job = JobSpec {
        workload: Some("lenet_25".to_string()),
        ..parse_ok(EXPLICIT).remove(0)
    };
    let back = parse_ok(&job.to_json_line()).remove(0);
    assert_eq!(
        JobSpec {
            workload: None,
            ..job
        },
        back
    );
}

#[test]
fn a_whole_trace_round_trips() {
    let text = format!("{EXPLICIT}\n{FROM_CATALOG}\n");
    let jobs = parse_ok(&text);
    let written: Vec<String> = jobs.iter().map(JobSpec::to_json_line).collect();
    assert_eq!(parse_ok(&written.join("\n")), jobs);
}

#[test]
fn reads_trace_files_and_reports_io_errors_with_the_path() {
    let dir = std::env::temp_dir().join(format!("salus-trace-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap_or_else(|err| panic!("{err}"));
    let path = dir.join("trace.jsonl");
    std::fs::write(&path, format!("{EXPLICIT}\n{FROM_CATALOG}\n"))
        .unwrap_or_else(|err| panic!("{err}"));
    let jobs = read_trace(&path).unwrap_or_else(|err| panic!("{err}"));
    assert_eq!(jobs.len(), 2);

    let missing = dir.join("absent.jsonl");
    let err = match read_trace(&missing) {
        Ok(jobs) => panic!("read {jobs:?} from a missing file"),
        Err(err) => err,
    };
    assert_eq!(err.line, 0);
    assert!(
        err.message.contains(&missing.display().to_string()),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap_or_else(|err| panic!("{err}"));
}
