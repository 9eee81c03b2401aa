//! The Rust description against the source NVRTC compiles: the argument structs field by
//! field, each kernel's parameter, and the codes the kernel files use.

use std::collections::{BTreeMap, BTreeSet};

use super::*;

/// The source with its comments blanked out (string literals hold no `//` here).
fn strip_comments(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix("//") {
            rest = after.find('\n').map_or("", |i| &after[i..]);
        } else if let Some(after) = rest.strip_prefix("/*") {
            rest = after.find("*/").map_or("", |i| &after[i + 2..]);
            out.push(' ');
        } else {
            let c = rest.chars().next().unwrap();
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    out
}

/// `#define NAME VALUE` lines whose value is an integer.
fn integer_defines(source: &str) -> BTreeMap<String, i64> {
    source
        .lines()
        .filter_map(|l| {
            let mut words = l.trim().strip_prefix("#define ")?.split_whitespace();
            let (name, value) = (words.next()?, words.next()?);
            Some((name.to_string(), value.parse().ok()?))
        })
        .collect()
}

/// Every `struct Name { ... };` of the source with its fields (name, C type, array
/// length) in order, as C declares them.
type CFields = Vec<(String, String, Option<usize>)>;

fn c_structs(source: &str) -> Vec<(String, CFields)> {
    let defines = integer_defines(source);
    let code = strip_comments(source);
    let mut out = Vec::new();
    let mut rest = code.as_str();
    while let Some(at) = rest.find("struct ") {
        let after = &rest[at + "struct ".len()..];
        let name: String = after
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let Some(open) = after[name.len()..].trim_start().strip_prefix('{') else {
            rest = after;
            continue;
        };
        let close = open.find("};").expect("struct without an end");
        let mut fields = Vec::new();
        for decl in open[..close]
            .split(';')
            .map(str::trim)
            .filter(|d| !d.is_empty())
        {
            let (ty, names) = decl.split_once(char::is_whitespace).expect("a field");
            for declarator in names.split(',').map(str::trim) {
                let (field, len) = match declarator.split_once('[') {
                    Some((field, len)) => {
                        let len = len.trim_end_matches(']').trim();
                        let len = len
                            .parse()
                            .ok()
                            .or_else(|| defines.get(len).map(|&v| v as usize))
                            .unwrap_or_else(|| panic!("array length {len} of {name}"));
                        (field.trim(), Some(len))
                    }
                    None => (declarator, None),
                };
                fields.push((field.to_string(), ty.trim().to_string(), len));
            }
        }
        out.push((name, fields));
        rest = &open[close..];
    }
    out
}

/// A field as (name, C type, array length, offset).
type Placed = (String, String, Option<usize>, usize);

/// The layout C gives a struct: every field 8-byte aligned, so offsets add up with no
/// padding. Sizes of nested structs come from `sizes`.
fn c_layout(fields: &CFields, sizes: &BTreeMap<String, usize>) -> (Vec<Placed>, usize) {
    let mut offset = 0;
    let mut out = Vec::new();
    for (name, ty, len) in fields {
        let size = match ty.as_str() {
            "i64" | "u64" | "double" => 8,
            other => *sizes
                .get(other)
                .unwrap_or_else(|| panic!("field {name} has a type of unknown size: {ty}")),
        };
        out.push((name.clone(), ty.clone(), *len, offset));
        offset += size * len.unwrap_or(1);
    }
    (out, offset)
}

fn rust_layout(s: &StructLayout) -> Vec<Placed> {
    s.fields
        .iter()
        .map(|f| (f.name.to_string(), f.c_type.to_string(), f.len, f.offset))
        .collect()
}

#[test]
fn argument_structs_match_the_cuda_source_field_by_field() {
    let source = kernel_source();
    let parsed = c_structs(&source);
    let mut sizes = BTreeMap::new();
    for rust in structs() {
        let defs: Vec<_> = parsed.iter().filter(|(n, _)| n == rust.name).collect();
        assert_eq!(
            defs.len(),
            1,
            "{} must be defined once in the kernels' source",
            rust.name
        );
        let (fields, size) = c_layout(&defs[0].1, &sizes);
        assert_eq!(
            fields,
            rust_layout(&rust),
            "{}: the CUDA fields (name, type, length, offset) differ from the Rust struct",
            rust.name
        );
        assert_eq!(size, rust.size, "{}: size", rust.name);
        sizes.insert(rust.name.to_string(), size);
    }
    // Nothing else in the source defines a struct (no hand-kept copies).
    let known: BTreeSet<_> = structs().iter().map(|s| s.name.to_string()).collect();
    for (name, _) in &parsed {
        assert!(known.contains(name), "struct {name} is not from abi.rs");
    }
}

#[test]
fn every_kernel_takes_its_argument_struct() {
    let code = strip_comments(&kernel_source());
    let mut found = BTreeMap::new();
    for piece in code.split("extern \"C\" __global__ void ").skip(1) {
        let (name, rest) = piece.split_once('(').expect("a kernel's parameters");
        let params = &rest[..rest.find(')').expect("a kernel's parameters")];
        let words: Vec<&str> = params.split_whitespace().collect();
        assert!(
            matches!(words.as_slice(), ["const", _, "a"]),
            "kernel {name} must take one argument struct by value, takes ({params})"
        );
        found.insert(name.trim().to_string(), words[1].to_string());
    }
    let want: BTreeMap<String, String> = Kernel::ALL
        .iter()
        .map(|k| (k.name().to_string(), k.args_struct().to_string()))
        .collect();
    assert_eq!(found, want);
}

#[test]
fn kernel_files_use_the_prelude_names_and_define_none() {
    let prelude = prelude();
    let defined = integer_defines(&prelude);
    let families = ["OP_", "DT_", "RED_", "ALONG_", "ERR_"];
    let constants = ["MAXR", "BLOCK"];
    let mut used = BTreeSet::new();
    for (file, text) in KERNEL_FILES {
        let code = strip_comments(text);
        for line in code.lines() {
            let line = line.trim();
            if let Some(name) = line.strip_prefix("#define ") {
                let name = name
                    .split(|c: char| !c.is_alphanumeric() && c != '_')
                    .next();
                assert!(
                    !name.is_some_and(|n| defined.contains_key(n)),
                    "{file} defines {line:?}, which the prelude defines"
                );
            }
            assert!(!line.starts_with("typedef"), "{file}: {line:?}");
        }
        for word in code.split(|c: char| !c.is_alphanumeric() && c != '_') {
            if families.iter().any(|f| word.starts_with(f)) || constants.contains(&word) {
                assert!(
                    defined.contains_key(word),
                    "{file} uses {word}, which the prelude does not define"
                );
                used.insert(word.to_string());
            }
        }
    }
    // Every elementwise op has its case in `apply` (the other families have a default
    // branch: bool loads, sums, scatter_add; some index errors come through
    // TakeRowsArgs::code).
    for name in ElementwiseOp::ALL.iter().map(|c| c.c_name()) {
        assert!(used.contains(name), "no kernel uses {name}");
    }
}

#[test]
fn codes_are_distinct_within_each_family() {
    for (family, defines) in codes() {
        let values: BTreeSet<_> = defines.iter().map(|d| d.1).collect();
        assert_eq!(values.len(), defines.len(), "{family}");
    }
    assert_eq!(IndexErrorKind::from_code(0), None);
    assert_eq!(
        index_error(IndexErrorKind::IndexPut.code() as u64, -7, 3),
        "index_put index -7 is out of range for a dimension of size 3"
    );
}

#[test]
fn every_kernel_file_ends_its_last_line() {
    // The files are joined: one without a final newline would glue its last line onto the
    // next file's first (a comment swallowing a declaration).
    assert!(prelude().ends_with('\n'));
    assert!(KERNEL_FILES.iter().all(|(_, f)| f.ends_with('\n')));
    let joined: String = KERNEL_FILES.iter().map(|(_, f)| *f).collect();
    assert_eq!(prelude() + &joined, kernel_source());
}

/// Compiles the kernels' source as host C++ with stand-ins for the CUDA built-ins
/// (the emulator's `runtime.h`), when a C++ compiler is there: a check of syntax, names and types of
/// the generated prelude and the kernel files together on machines without NVRTC.
#[test]
fn the_kernel_source_compiles_as_host_cpp() {
    match host_compiles(&kernel_source()) {
        None => eprintln!("skipped: no C++ compiler"),
        Some(Err(log)) => panic!("the kernels' source does not compile as host C++:\n{log}"),
        Some(Ok(())) => {}
    }
}

/// `Some(result)` of compiling `source` as host C++ with the emulator's stand-ins (`runtime.h`),
/// `None` without a C++ compiler (`$CXX`, else `c++`).
pub(crate) fn host_compiles(source: &str) -> Option<Result<(), String>> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static RUN: AtomicUsize = AtomicUsize::new(0);
    let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let dir = std::env::temp_dir().join(format!(
        "salus-cuda-host-check-{}-{}",
        std::process::id(),
        RUN.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let (stubs, file) = (dir.join("runtime.h"), dir.join("kernels.cu"));
    std::fs::write(&stubs, include_str!("../emulator/runtime.h")).unwrap();
    std::fs::write(&file, source).unwrap();
    let run = std::process::Command::new(&compiler)
        .args(["-std=c++14", "-fsyntax-only", "-include"])
        .arg(&stubs)
        .args(["-x", "c++"])
        .arg(&file)
        .output();
    let _ = std::fs::remove_dir_all(&dir);
    match run {
        Err(_) => None,
        Ok(out) if out.status.success() => Some(Ok(())),
        Ok(out) => Some(Err(String::from_utf8_lossy(&out.stderr).into_owned())),
    }
}

/// Compiles the kernels' source with NVRTC for sm_90 where the NVRTC library can be loaded
/// (no GPU needed): the real compiler's check of what the GPU will load. Skips elsewhere.
#[test]
fn the_kernel_source_compiles_with_nvrtc_where_present() {
    let source = kernel_source();
    match nvrtc_compiles(&source) {
        None => eprintln!("skipped: no NVRTC library"),
        Some(Err(log)) => panic!("NVRTC rejects the kernels' source:\n{log}"),
        Some(Ok(())) => {}
    }
}

/// `Some(result)` of compiling `source` for sm_90 with NVRTC, `None` without the library.
pub(crate) fn nvrtc_compiles(source: &str) -> Option<Result<(), String>> {
    let run = std::panic::catch_unwind(|| crate::driver::nvrtc_compile(source, 90));
    match run {
        Err(_) => None,
        Ok(Ok((_, true))) => Some(Ok(())),
        Ok(Ok((_, false))) => Some(Err("NVRTC made PTX, not sm_90 machine code".into())),
        Ok(Err(e)) => Some(Err(e)),
    }
}
