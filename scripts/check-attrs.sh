#!/usr/bin/env bash
# Fails if Rust code reads a node's attributes by name after validation.
#
# Validation reads every node's attributes once into typed parameters
# (salus_graph::OpParams, CheckedGraph::params); everything after it (shape inference, the
# planner, the kernels, the CUDA lowering, the sim cost model) reads those instead. This
# check looks through the `src/` of every crate for the ways code reads attributes:
#
#   - `.attrs` field access (`node.attrs.get("alpha")`, `&node.attrs`, ...);
#   - a call handing a node and an attribute name to a helper (`attr_int(node, "groups")`,
#     `pair(node, "stride", ...)`), and any `*attr*(node, ..)` helper;
#   - matching on an attribute value (`Some(Attr::Int(g))`, `Attr::Str(s) =>`,
#     `matches!(.., Attr::Bool(true))`).
#
# Allowed: salus-graph's params module (the one reader), validate.rs (which hands the
# attributes to it), convert.rs (protobuf conversion) and samples.rs (builds graphs), and
# every test, bench and example directory (they build graphs, which is construction, not
# reading). Prints each offending file:line and a count per file.
#
# scripts/test.sh runs this before the Rust tests.
set -euo pipefail
cd "$(dirname "$0")/.."

allowed='^crates/salus-graph/src/(params/|validate\.rs$|convert\.rs$|samples\.rs$)'
pattern='\.attrs\b|\b[a-z_]*attrs?[a-z0-9_]*\(\s*&?node\b|\(\s*&?node\s*,\s*"[A-Za-z_.]+"|(Some\(|matches!\(.*)Attr::|Attr::[A-Za-z]+(\([^)]*\))?\s*(=>|\|)'

offences=$(
    find crates -path '*/src/*' -name '*.rs' -not -path '*/target/*' | sort |
        grep -Ev "$allowed" |
        xargs grep -nHE "$pattern" |
        grep -vE '^[^:]+:[0-9]+:\s*//' || true
)

if [[ -z "$offences" ]]; then
    echo "check-attrs: no attribute is read by name after validation"
    exit 0
fi
echo "check-attrs: attributes read by name after validation (read OpParams instead):"
echo "$offences"
echo
echo "check-attrs: per file:"
cut -d: -f1 <<<"$offences" | uniq -c | sort -rn
exit 1
