//! Errors about a graph: every one says where (tensor or node, op, source) and what.

/// Why a graph was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GraphError {
    /// Something about the graph as a whole.
    #[error("graph: {0}")]
    Graph(String),
    /// Something about one tensor.
    #[error("tensor {id} '{}': {message}", cut(.name, PREVIEW_CHARS))]
    Tensor {
        /// Its id.
        id: usize,
        /// Its name.
        name: String,
        /// What is wrong.
        message: String,
    },
    /// Something about one node.
    #[error(
        "node {index} '{}' ({}{}): {message}",
        cut(.name, PREVIEW_CHARS),
        cut(.op, PREVIEW_CHARS),
        origin_suffix(.origin)
    )]
    Node {
        /// Position in the node list.
        index: usize,
        /// Its name.
        name: String,
        /// Its op.
        op: String,
        /// Where it came from in the user's model.
        origin: String,
        /// What is wrong.
        message: String,
    },
}

fn origin_suffix(origin: &str) -> String {
    if origin.is_empty() {
        String::new()
    } else {
        format!(", from {}", cut(origin, 4 * PREVIEW_CHARS))
    }
}

/// `s`, or its first `limit` characters and how many there are in all.
fn cut(s: &str, limit: usize) -> std::borrow::Cow<'_, str> {
    let count = s.chars().count();
    if count <= limit {
        return s.into();
    }
    let head: String = s.chars().take(limit).collect();
    format!("{head}... ({count} characters)").into()
}

/// How many entries of a client's list an error message shows.
const PREVIEW_VALUES: usize = 8;
/// How many characters of a client's name an error message shows.
const PREVIEW_CHARS: usize = 64;

/// A list from the client as an error message shows it: the first few entries, then how
/// many there are in all, so an absurd input never makes an absurd message.
pub(crate) fn preview<T: std::fmt::Debug>(values: &[T]) -> String {
    if values.len() <= PREVIEW_VALUES {
        return format!("{values:?}");
    }
    let head: Vec<String> = values[..PREVIEW_VALUES]
        .iter()
        .map(|v| format!("{v:?}"))
        .collect();
    format!("[{}, ... ({} values)]", head.join(", "), values.len())
}

/// A name from the client as an error message shows it (quoted, cut to a few dozen
/// characters).
pub(crate) fn preview_str(s: &str) -> String {
    let count = s.chars().count();
    if count <= PREVIEW_CHARS {
        return format!("{s:?}");
    }
    let head: String = s.chars().take(PREVIEW_CHARS).collect();
    format!("{head:?}... ({count} characters)")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn previews_cut_long_input() {
        assert_eq!(preview(&[1, 2, 3]), "[1, 2, 3]");
        let long: Vec<i64> = (0..100_000).collect();
        assert_eq!(
            preview(&long),
            "[0, 1, 2, 3, 4, 5, 6, 7, ... (100000 values)]"
        );
        assert_eq!(preview_str("dims"), "\"dims\"");
        let name = "x".repeat(10_000);
        let shown = preview_str(&name);
        assert!(
            shown.len() < 100 && shown.ends_with("(10000 characters)"),
            "{shown}"
        );
    }
}
