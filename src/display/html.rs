//! Small HTML builders shared by every renderer.

/// Escapes text for HTML element content and attribute values.
pub(crate) fn escape(s: &str) -> String {
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

/// The end of a prompt for a table cell, read as text: the chat template's closing generation
/// header (`<|im_start|>assistant`) dropped, special-token markup (`<|…|>`) removed, whitespace
/// collapsed, and cut at a word boundary (never mid-token) to about `n` characters after a `…`.
pub(crate) fn prompt_tail(text: &str, n: usize) -> String {
    let mut body = text.trim_end();
    // A generation header: `<|im_start|>assistant` or `<|start_header_id|>assistant<|end_header_id|>`.
    if let Some(role) = body.rfind("assistant").filter(|&r| body.len() - r < 40)
        && let Some(open) = body[..role].rfind("<|").filter(|&o| role - o < 25)
    {
        body = &body[..open];
    }
    let mut plain = String::with_capacity(body.len());
    let mut rest = body;
    while let Some(start) = rest.find("<|") {
        plain.push_str(&rest[..start]);
        plain.push(' ');
        rest = rest[start..].find("|>").map_or("", |end| &rest[start + end + 2..]);
    }
    plain.push_str(rest);
    let words: Vec<&str> = plain.split_whitespace().collect();
    let mut kept: Vec<&str> = Vec::new();
    let mut len = 0;
    for w in words.iter().rev() {
        if len > 0 && len + w.chars().count() + 1 > n {
            break;
        }
        len += w.chars().count() + 1;
        kept.push(w);
    }
    kept.reverse();
    let tail = kept.join(" ");
    match kept.len() < words.len() {
        true => format!("…{tail}"),
        false => tail,
    }
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
pub(crate) fn kv_table(rows: &[(&str, String)]) -> String {
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
    fn prompt_tails_read_as_text() {
        let chat = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 7 times 8? Answer: N<|im_end|>\n<|im_start|>assistant\n";
        assert_eq!(
            prompt_tail(chat, 200),
            "system Be brief. user What is 7 times 8? Answer: N"
        );
        assert_eq!(prompt_tail(chat, 30), "…What is 7 times 8? Answer: N");
        assert_eq!(prompt_tail("<|im_start|>user\nHi<|im_end|>", 30), "user Hi");
        let llama = "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n";
        assert_eq!(prompt_tail(llama, 100), "user Hi there");
        assert_eq!(prompt_tail("plain words only", 100), "plain words only");
    }

    #[test]
    fn table_right_aligns_numbers_only() {
        let t = table(&["name", "n"], &[vec!["cpu".into(), "1,024".into()]]);
        assert!(t.contains("<td>cpu</td>"));
        assert!(t.contains("<td class=\"num\">1,024</td>"));
        assert!(t.contains("<th>name</th>"));
    }
}
