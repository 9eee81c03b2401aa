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
mod tests;
