//! Plain-text tables, as kubectl prints them: the agent's `top` and the kubectl plugin share this one.

/// Columns padded to their widest cell (in characters), two spaces apart, trailing spaces trimmed; one
/// line per row, each ending with a newline.
///
/// ```
/// use gpubudget_common::text::table;
/// let rows = [vec!["NAME".to_owned(), "USAGE".into()], vec!["llm-0".into(), "9Gi".into()]];
/// assert_eq!(table(&rows), "NAME   USAGE\nllm-0  9Gi\n");
/// ```
pub fn table(rows: &[Vec<String>]) -> String {
    padded(rows, 2, 0)
}

/// Columns as `kubectl get` prints a server's Table (Go's tabwriter as kubectl sets it up: each cell but the
/// last padded by 3 spaces, a column at least 6 wide), trailing spaces trimmed.
///
/// ```
/// use gpubudget_common::text::kubectl_get;
/// let rows = [vec!["NAME".to_owned(), "AGE".into()], vec!["a".into(), "5s".into()], vec!["bb".into(), "1m".into()]];
/// assert_eq!(kubectl_get(&rows), "NAME   AGE\na      5s\nbb     1m\n");
/// assert_eq!(kubectl_get(&[vec!["X".to_owned(), "Y".into()]]), "X     Y\n", "at least 6 wide");
/// ```
pub fn kubectl_get(rows: &[Vec<String>]) -> String {
    padded(rows, 3, 6)
}

/// Each column as wide as its widest cell plus `gap`, and at least `min_width`.
fn padded(rows: &[Vec<String>], gap: usize, min_width: usize) -> String {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..columns)
        .map(|c| rows.iter().filter_map(|r| r.get(c)).map(|s| s.chars().count()).max().unwrap_or(0))
        .map(|w| (w + gap).max(min_width))
        .collect();
    let mut out = String::new();
    for row in rows {
        let line: String = row.iter().enumerate().map(|(c, s)| format!("{s:<w$}", w = widths[c])).collect();
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pads_every_column_but_trims_the_end() {
        let rows = [vec!["A".into(), "LONGER".into(), "X".into()], vec!["abc".into(), "d".into(), "tail end".into()]];
        assert_eq!(table(&rows), "A    LONGER  X\nabc  d       tail end\n");
        assert_eq!(table(&[vec!["é".into(), "b".into()], vec!["cc".into()]]), "é   b\ncc\n", "characters, not bytes");
        assert_eq!(table(&[]), "");
    }
}
