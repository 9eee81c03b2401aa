//! Job traces: JSON Lines files with one training job per line.
//!
//! A job either names a catalog workload,
//!
//! ```text
//! {"id":"j1","arrival_s":0.0,"iterations":1200,"model":"googlenet","batch_size":25}
//! ```
//!
//! or gives its figures explicitly,
//!
//! ```text
//! {"id":"j2","arrival_s":5.0,"iterations":300,"iteration_s":0.21,"persistent_bytes":110900000,"ephemeral_bytes":3100000000,"compute_share":0.7}
//! ```
//!
//! `batch_size` is a JSON integer (`25`) or a string (`"25"`, `"small"`); the workload is
//! resolved through [`crate::catalog::lookup`]. Blank lines are skipped, jobs keep file order,
//! and every error names its 1-based line number and the field at fault. A trace must hold
//! at least one job.

use std::collections::HashMap;
use std::path::Path;

use serde::Serialize;
use serde_json::{Map, Value};

use crate::catalog;

/// One job of a trace, with its figures resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct JobSpec {
    /// Identifier, unique within the trace.
    pub id: String,
    /// Arrival time in seconds from the start of the trace (finite, >= 0).
    pub arrival_s: f64,
    /// Number of training iterations the job runs (>= 1).
    pub iterations: u64,
    /// Duration of one iteration with the GPU to itself, in seconds (finite, > 0).
    pub iteration_s: f64,
    /// Memory resident for the job's whole life, in bytes.
    pub persistent_bytes: u64,
    /// Memory needed only while an iteration runs, in bytes (> 0).
    pub ephemeral_bytes: u64,
    /// Share of the GPU's compute the job keeps busy when running alone, in (0, 1].
    pub compute_share: f64,
    /// Catalog workload the figures came from (`"googlenet_25"`), if the line named one.
    pub workload: Option<String>,
}

/// Why a trace could not be read: the 1-based line at fault (0 for the trace as a whole or
/// for I/O) and what is wrong with it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("line {line}: {message}")]
pub struct TraceError {
    /// 1-based line number; 0 when the error concerns the whole trace or its file.
    pub line: usize,
    /// What is wrong, naming the field at fault where there is one.
    pub message: String,
}

/// Fields every job has.
const COMMON_FIELDS: [&str; 3] = ["id", "arrival_s", "iterations"];
/// Fields of a job that names a catalog workload.
const CATALOG_FIELDS: [&str; 2] = ["model", "batch_size"];
/// Fields of a job that gives its figures itself.
const EXPLICIT_FIELDS: [&str; 4] = [
    "iteration_s",
    "persistent_bytes",
    "ephemeral_bytes",
    "compute_share",
];

/// Parses a trace held in memory. See the module documentation for the format.
pub fn parse_trace(text: &str) -> Result<Vec<JobSpec>, TraceError> {
    let mut jobs = Vec::new();
    let mut id_lines: HashMap<String, usize> = HashMap::new();
    for (index, raw) in text.lines().enumerate() {
        let line = index + 1;
        if raw.trim().is_empty() {
            continue;
        }
        let job = parse_line(raw).map_err(|message| TraceError { line, message })?;
        if let Some(earlier) = id_lines.get(&job.id) {
            return Err(TraceError {
                line,
                message: format!(
                    "field \"id\": {:?} is already the id of the job on line {earlier}",
                    job.id
                ),
            });
        }
        id_lines.insert(job.id.clone(), line);
        jobs.push(job);
    }
    if jobs.is_empty() {
        return Err(TraceError {
            line: 0,
            message: "trace has no jobs".to_string(),
        });
    }
    Ok(jobs)
}

/// Reads and parses the trace file at `path`. I/O errors come back as line 0, naming the
/// path.
pub fn read_trace(path: &Path) -> Result<Vec<JobSpec>, TraceError> {
    let text = std::fs::read_to_string(path).map_err(|err| TraceError {
        line: 0,
        message: format!("cannot read trace {}: {err}", path.display()),
    })?;
    parse_trace(&text)
}

impl JobSpec {
    /// One trace line (no trailing newline) that [`parse_trace`] reads back as this job.
    ///
    /// A job whose `workload` names a catalog entry whose figures it still carries is
    /// written in the short `model`/`batch_size` form. Any other job is written with its
    /// four figures explicit; the explicit form has no place for a workload name, so a job
    /// whose figures were changed after it was resolved reads back with `workload: None`.
    pub fn to_json_line(&self) -> String {
        let serialized = match self.catalog_entry() {
            Some(entry) => serde_json::to_string(&CatalogLine {
                id: &self.id,
                arrival_s: self.arrival_s,
                iterations: self.iterations,
                model: entry.model,
                batch_size: match entry.batch.parse::<u64>() {
                    Ok(number) => BatchSize::Number(number),
                    Err(_) => BatchSize::Name(entry.batch),
                },
            }),
            None => serde_json::to_string(&ExplicitLine {
                id: &self.id,
                arrival_s: self.arrival_s,
                iterations: self.iterations,
                iteration_s: self.iteration_s,
                persistent_bytes: self.persistent_bytes,
                ephemeral_bytes: self.ephemeral_bytes,
                compute_share: self.compute_share,
            }),
        };
        // Both line types hold only strings, integers and floats, which serde_json always
        // serializes (a non-finite float becomes null, which parse_trace then refuses).
        serialized.expect("a trace line serializes")
    }

    /// The catalog entry this job can be written as: its workload, if that exists and the
    /// job's figures are still the entry's.
    fn catalog_entry(&self) -> Option<&'static catalog::Workload> {
        let entry = catalog::by_name(self.workload.as_deref()?)?;
        let same_figures = entry.iteration_s == self.iteration_s
            && entry.persistent_bytes == self.persistent_bytes
            && entry.ephemeral_bytes == self.ephemeral_bytes
            && entry.compute_share == self.compute_share;
        same_figures.then_some(entry)
    }
}

#[derive(Serialize)]
struct CatalogLine<'a> {
    id: &'a str,
    arrival_s: f64,
    iterations: u64,
    model: &'a str,
    batch_size: BatchSize<'a>,
}

#[derive(Serialize)]
#[serde(untagged)]
enum BatchSize<'a> {
    Number(u64),
    Name(&'a str),
}

#[derive(Serialize)]
struct ExplicitLine<'a> {
    id: &'a str,
    arrival_s: f64,
    iterations: u64,
    iteration_s: f64,
    persistent_bytes: u64,
    ephemeral_bytes: u64,
    compute_share: f64,
}

/// Parses one non-blank line into a job; the error is the message without the line number.
fn parse_line(raw: &str) -> Result<JobSpec, String> {
    let value: Value = serde_json::from_str(raw).map_err(|err| format!("malformed JSON: {err}"))?;
    let Value::Object(fields) = value else {
        return Err(format!(
            "expected a JSON object for the job, found {}",
            kind_of(&value)
        ));
    };
    let texts = member_texts(raw);

    let unknown: Vec<String> = fields
        .keys()
        .filter(|key| {
            !COMMON_FIELDS
                .iter()
                .chain(&CATALOG_FIELDS)
                .chain(&EXPLICIT_FIELDS)
                .any(|known| known == key)
        })
        .map(|key| format!("{key:?}"))
        .collect();
    if !unknown.is_empty() {
        return Err(format!(
            "unknown field{} {}; a job has {}, and either {} or {}",
            plural(unknown.len()),
            unknown.join(", "),
            COMMON_FIELDS.join(", "),
            CATALOG_FIELDS.join(" and "),
            EXPLICIT_FIELDS.join(", "),
        ));
    }

    let present = |names: &[&'static str]| -> Vec<&'static str> {
        names
            .iter()
            .copied()
            .filter(|name| fields.contains_key(*name))
            .collect()
    };
    let catalog_present = present(&CATALOG_FIELDS);
    let explicit_present = present(&EXPLICIT_FIELDS);
    if !catalog_present.is_empty() && !explicit_present.is_empty() {
        return Err(format!(
            "mixes catalog fields ({}) with explicit fields ({}): a job names a catalog \
             workload or gives its figures, one form or the other",
            catalog_present.join(", "),
            explicit_present.join(", "),
        ));
    }

    let uses_catalog = !catalog_present.is_empty();
    let neither_form = catalog_present.is_empty() && explicit_present.is_empty();
    let form_fields: &[&str] = if uses_catalog {
        &CATALOG_FIELDS
    } else if neither_form {
        &[]
    } else {
        &EXPLICIT_FIELDS
    };
    let missing: Vec<&str> = COMMON_FIELDS
        .iter()
        .chain(form_fields)
        .copied()
        .filter(|name| !fields.contains_key(*name))
        .collect();
    if !missing.is_empty() || neither_form {
        let mut parts = Vec::new();
        if !missing.is_empty() {
            parts.push(missing.join(", "));
        }
        if neither_form {
            parts.push(format!(
                "either {} (a catalog workload) or {} (explicit figures)",
                CATALOG_FIELDS.join(" and "),
                EXPLICIT_FIELDS.join(", "),
            ));
        }
        let count = missing.len() + if neither_form { 2 } else { 0 };
        return Err(format!(
            "missing field{} {}",
            plural(count),
            parts.join(", and ")
        ));
    }

    let id = string_field(&fields, "id")?;
    if id.is_empty() {
        return Err("field \"id\": must not be empty".to_string());
    }
    let arrival_s = number_field(&fields, &texts, "arrival_s")?;
    if !arrival_s.is_finite() || arrival_s < 0.0 {
        return Err(format!(
            "field \"arrival_s\": must be a finite number >= 0, found {arrival_s}"
        ));
    }
    let iterations = integer_field(&fields, "iterations")?;
    if iterations == 0 {
        return Err("field \"iterations\": must be at least 1, found 0".to_string());
    }

    if uses_catalog {
        let workload = resolve_workload(&fields)?;
        return Ok(JobSpec {
            id,
            arrival_s,
            iterations,
            iteration_s: workload.iteration_s,
            persistent_bytes: workload.persistent_bytes,
            ephemeral_bytes: workload.ephemeral_bytes,
            compute_share: workload.compute_share,
            workload: Some(workload.name()),
        });
    }

    let iteration_s = number_field(&fields, &texts, "iteration_s")?;
    if !iteration_s.is_finite() || iteration_s <= 0.0 {
        return Err(format!(
            "field \"iteration_s\": must be a finite number > 0, found {iteration_s}"
        ));
    }
    let persistent_bytes = integer_field(&fields, "persistent_bytes")?;
    let ephemeral_bytes = integer_field(&fields, "ephemeral_bytes")?;
    if ephemeral_bytes == 0 {
        return Err("field \"ephemeral_bytes\": must be at least 1, found 0".to_string());
    }
    let compute_share = number_field(&fields, &texts, "compute_share")?;
    if !(compute_share > 0.0 && compute_share <= 1.0) {
        return Err(format!(
            "field \"compute_share\": must be in (0, 1], found {compute_share}"
        ));
    }
    Ok(JobSpec {
        id,
        arrival_s,
        iterations,
        iteration_s,
        persistent_bytes,
        ephemeral_bytes,
        compute_share,
        workload: None,
    })
}

/// The catalog workload named by the `model` and `batch_size` fields.
fn resolve_workload(fields: &Map<String, Value>) -> Result<&'static catalog::Workload, String> {
    let model = string_field(fields, "model")?;
    let batch = match fields.get("batch_size") {
        Some(Value::String(text)) => text.clone(),
        Some(Value::Number(number)) if number.is_u64() => number.to_string(),
        Some(other) => {
            return Err(format!(
                "field \"batch_size\": expected a non-negative integer or a string, found {}",
                describe(other)
            ));
        }
        None => return Err("missing field batch_size".to_string()),
    };
    let batches: Vec<&str> = catalog::catalog()
        .iter()
        .filter(|workload| workload.model == model)
        .map(|workload| workload.batch)
        .collect();
    if batches.is_empty() {
        let mut models: Vec<&str> = catalog::catalog().iter().map(|w| w.model).collect();
        models.dedup();
        return Err(format!(
            "field \"model\": unknown model {model:?}; the catalog has {}",
            models.join(", ")
        ));
    }
    catalog::lookup(&model, &batch).ok_or_else(|| {
        format!(
            "field \"batch_size\": model {model:?} has no batch size {batch:?}; \
             its batch sizes are {}",
            batches.join(", ")
        )
    })
}

fn string_field(fields: &Map<String, Value>, name: &str) -> Result<String, String> {
    match fields.get(name) {
        Some(Value::String(text)) => Ok(text.clone()),
        Some(other) => Err(format!(
            "field {name:?}: expected a string, found {}",
            describe(other)
        )),
        None => Err(format!("missing field {name}")),
    }
}

/// A number field, read from its JSON text so that it is the `f64` nearest to that text:
/// serde_json's own conversion may land one unit in the last place away, and a trace written
/// by [`JobSpec::to_json_line`] must read back bit for bit.
fn number_field(
    fields: &Map<String, Value>,
    texts: &HashMap<String, &str>,
    name: &str,
) -> Result<f64, String> {
    match fields.get(name) {
        Some(Value::Number(number)) => texts
            .get(name)
            .and_then(|text| text.parse::<f64>().ok())
            .or_else(|| number.as_f64())
            .ok_or_else(|| format!("field {name:?}: {number} is not representable as a number")),
        Some(other) => Err(format!(
            "field {name:?}: expected a number, found {}",
            describe(other)
        )),
        None => Err(format!("missing field {name}")),
    }
}

fn integer_field(fields: &Map<String, Value>, name: &str) -> Result<u64, String> {
    match fields.get(name) {
        Some(Value::Number(number)) => number.as_u64().ok_or_else(|| {
            format!("field {name:?}: expected a non-negative integer, found {number}")
        }),
        Some(other) => Err(format!(
            "field {name:?}: expected a non-negative integer, found {}",
            describe(other)
        )),
        None => Err(format!("missing field {name}")),
    }
}

/// The JSON text of each member value of the object on `line`, by member name (the last one
/// wins, as in serde_json). Only called on lines serde_json has already accepted as an
/// object, so the scan need not check the syntax; anything unexpected ends it early.
fn member_texts(line: &str) -> HashMap<String, &str> {
    let bytes = line.as_bytes();
    let mut texts = HashMap::new();
    let Some(open) = line.find('{') else {
        return texts;
    };
    let mut at = open + 1;
    loop {
        at = skip_whitespace(bytes, at);
        if bytes.get(at) != Some(&b'"') {
            break;
        }
        let key_end = string_end(bytes, at);
        let key = line
            .get(at..key_end)
            .and_then(|text| serde_json::from_str::<String>(text).ok());
        at = skip_whitespace(bytes, key_end);
        if bytes.get(at) != Some(&b':') {
            break;
        }
        let value_start = skip_whitespace(bytes, at + 1);
        let value_end = value_end(bytes, value_start);
        if let (Some(key), Some(text)) = (key, line.get(value_start..value_end)) {
            texts.insert(key, text);
        }
        at = skip_whitespace(bytes, value_end);
        if bytes.get(at) != Some(&b',') {
            break;
        }
        at += 1;
    }
    texts
}

fn skip_whitespace(bytes: &[u8], mut at: usize) -> usize {
    while bytes.get(at).is_some_and(u8::is_ascii_whitespace) {
        at += 1;
    }
    at
}

/// Index just past the string that opens at `start` (a `"`).
fn string_end(bytes: &[u8], start: usize) -> usize {
    let mut at = start + 1;
    while let Some(&byte) = bytes.get(at) {
        match byte {
            b'\\' => at += 2,
            b'"' => return at + 1,
            _ => at += 1,
        }
    }
    bytes.len()
}

/// Index just past the JSON value that starts at `start`.
fn value_end(bytes: &[u8], start: usize) -> usize {
    match bytes.get(start) {
        Some(b'"') => string_end(bytes, start),
        Some(b'{' | b'[') => {
            let mut depth = 0usize;
            let mut at = start;
            while let Some(&byte) = bytes.get(at) {
                match byte {
                    b'"' => {
                        at = string_end(bytes, at);
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth = depth.saturating_sub(1);
                        if depth == 0 {
                            return at + 1;
                        }
                    }
                    _ => {}
                }
                at += 1;
            }
            bytes.len()
        }
        _ => {
            let mut at = start;
            while bytes.get(at).is_some_and(|byte| {
                !matches!(byte, b',' | b'}' | b']') && !byte.is_ascii_whitespace()
            }) {
                at += 1;
            }
            at
        }
    }
}

/// A value as an error message shows it: its kind, and the value itself when short.
fn describe(value: &Value) -> String {
    match value {
        Value::Null => "null".to_string(),
        Value::Bool(flag) => format!("boolean {flag}"),
        Value::Number(number) => format!("number {number}"),
        Value::String(text) => format!("string {text:?}"),
        Value::Array(_) | Value::Object(_) => kind_of(value).to_string(),
    }
}

fn kind_of(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn plural(count: usize) -> &'static str {
    if count == 1 { "" } else { "s" }
}

#[cfg(test)]
mod tests {
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
        let text =
            r#"{"id":"a","arrival_s":0,"iterations":1,"model":"seq2seq","batch_size":"huge"}"#;
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
        let seq =
            r#"{"id":"s","arrival_s":0,"iterations":1,"model":"seq2seq","batch_size":"large"}"#;
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
}
