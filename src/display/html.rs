//! Small HTML builders shared by every renderer.

/// Escapes text for HTML element content and attribute values.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            _ => out.push(c),
        }
    }
    out
}

/// The last `n` characters of `s` (the end of a long prompt is what tells prompts apart).
pub fn tail(s: &str, n: usize) -> String {
    let count = s.chars().count();
    s.chars().skip(count.saturating_sub(n)).collect()
}

/// A table with a header row; cells are already-escaped HTML. Cells that parse as numbers are
/// right-aligned.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut s = String::from("<table><thead><tr>");
    for h in headers {
        s.push_str(&format!("<th>{}</th>", escape(h)));
    }
    s.push_str("</tr></thead><tbody>");
    for row in rows {
        s.push_str("<tr>");
        for cell in row {
            let numeric = cell
                .trim()
                .trim_end_matches(['%', 's', 'x'])
                .replace(',', "")
                .parse::<f64>()
                .is_ok();
            if numeric {
                s.push_str(&format!("<td class=\"num\">{cell}</td>"));
            } else {
                s.push_str(&format!("<td>{cell}</td>"));
            }
        }
        s.push_str("</tr>");
    }
    s.push_str("</tbody></table>");
    s
}

/// A two-column key/value table; values are already-escaped HTML.
pub fn kv_table(rows: &[(&str, String)]) -> String {
    let mut s = String::from("<table><tbody>");
    for (k, v) in rows {
        s.push_str(&format!("<tr><th>{}</th><td>{v}</td></tr>", escape(k)));
    }
    s.push_str("</tbody></table>");
    s
}

/// A titled section.
pub fn section(title: &str, body: &str) -> String {
    format!("<h4>{}</h4>{body}", escape(title))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escape_covers_markup_characters() {
        assert_eq!(escape("<a href=\"x\">&'"), "&lt;a href=&quot;x&quot;&gt;&amp;&#39;");
    }

    #[test]
    fn table_right_aligns_numbers_only() {
        let t = table(&["name", "n"], &[vec!["cpu".into(), "1,024".into()]]);
        assert!(t.contains("<td>cpu</td>"));
        assert!(t.contains("<td class=\"num\">1,024</td>"));
        assert!(t.contains("<th>name</th>"));
    }
}
