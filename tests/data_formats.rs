//! Reading datasets in the formats TRL accepts, from every container treetrain supports.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, LargeListArray, LargeStringArray, RecordBatch, StructArray};
use arrow::buffer::OffsetBuffer;
use arrow::datatypes::{DataType, Field, Fields, Schema};
use serde_json::json;
use treetrain::data::{DataError, Dataset, Example};

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("treetrain-data-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn all(ds: &Dataset) -> Vec<Example> {
    let mut skipped = 0;
    ds.examples(false, &mut skipped).collect::<Result<_, _>>().unwrap()
}

#[test]
fn shipped_parquet_reads_back_what_the_generator_wrote() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("datasets");
    let sft = all(&Dataset::open(&root.join("sft/train.parquet")).unwrap());
    assert_eq!(sft.len(), 2000);
    let calculator = all(&Dataset::open(&root.join("sft/train-calculator.parquet")).unwrap());
    assert_eq!(calculator.len(), 2 * treetrain::shipped::datasets::SFT_CALCULATOR);
    let schema = json!([treetrain::shipped::calculator::Calculator::schema()]);
    for (i, ex) in calculator.iter().enumerate() {
        let Example::Conversation { messages, tools } = ex else {
            panic!()
        };
        assert_eq!(tools, &Some(schema.clone()));
        // Each question twice: answered directly, then through a call and the tool's result.
        assert_eq!(messages.len(), if i % 2 == 0 { 3 } else { 5 }, "{messages:?}");
    }
    let (first, _) = treetrain::shipped::datasets::sft_conversations(1, 1).remove(0);
    let want: Vec<serde_json::Value> = first
        .iter()
        .map(|m| json!({"role": m.role, "content": m.content}))
        .collect();
    assert_eq!(
        sft[0],
        Example::Conversation {
            messages: want,
            tools: None
        }
    );
    // A folder reads as `datasets.load_dataset` reads it: its train split by default.
    let grpo = all(&Dataset::open(&root.join("grpo")).unwrap());
    assert_eq!(
        grpo.len(),
        500,
        "train.parquet: the held-out test.parquet is another split"
    );
    assert!(matches!(&grpo[0], Example::Prompt(p) if p.as_array().unwrap().len() == 2));
    assert_eq!(
        all(&Dataset::open_split(&root.join("grpo"), Some("test")).unwrap()).len(),
        100
    );
    let both = all(&Dataset::open(&root.join("sft")).unwrap());
    assert_eq!(
        both.len(),
        2000 + 2 * treetrain::shipped::datasets::SFT_CALCULATOR,
        "both train files"
    );
}

/// `dir/name` holding `rows` JSON lines of one prompt each.
fn write_rows(dir: &Path, name: &str, rows: usize) {
    let path = dir.join(name);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let lines: Vec<String> = (0..rows).map(|i| format!("{{\"prompt\": \"q{i}\"}}")).collect();
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
}

#[test]
fn local_folders_split_as_datasets_load_dataset_splits_them() {
    let rows = |d: &Path, split: Option<&str>| Dataset::open_split(d, split).map(|ds| all(&ds).len());
    // Split files by name; a notebook's checkpoint copies are hidden; extensions in any case.
    let d = scratch("split-names");
    write_rows(&d, "train.jsonl", 3);
    write_rows(&d, "TEST.JSONL", 2);
    write_rows(&d, ".ipynb_checkpoints/train-checkpoint.jsonl", 3);
    write_rows(&d, "__pycache__/train.jsonl", 3);
    assert_eq!(rows(&d, None).unwrap(), 3);
    assert_eq!(rows(&d, Some("test")).unwrap(), 2);
    let err = rows(&d, Some("validation")).unwrap_err().to_string();
    assert!(err.contains("no `validation` split; its splits: test, train"), "{err}");
    // No file names a split: all of them are the train split.
    let d = scratch("no-split-names");
    write_rows(&d, "a.jsonl", 1);
    write_rows(&d, "b.JSONL", 2);
    assert_eq!(rows(&d, None).unwrap(), 3);
    // save_to_disk's DatasetDict: its own split names, metadata files skipped.
    let d = scratch("saved-dict");
    std::fs::write(d.join("dataset_dict.json"), r#"{"splits": ["train", "heldout"]}"#).unwrap();
    write_rows(&d, "train/data-00000-of-00001.jsonl", 4);
    write_rows(&d, "heldout/data-00000-of-00001.jsonl", 1);
    for split in ["train", "heldout"] {
        std::fs::write(d.join(split).join("dataset_info.json"), "{}").unwrap();
        std::fs::write(d.join(split).join("state.json"), "{}").unwrap();
    }
    assert_eq!(rows(&d, None).unwrap(), 4);
    assert_eq!(rows(&d, Some("heldout")).unwrap(), 1);
    assert_eq!(all(&Dataset::open_held_out(&d.join("heldout")).unwrap()).len(), 1);
    // One file is one train split.
    let err = rows(&d.join("train/data-00000-of-00001.jsonl"), Some("test")).unwrap_err();
    assert!(err.to_string().contains("no `test` split"), "{err}");
}

#[test]
fn jsonl_formats_prompt_completion_sharegpt_and_extra_fields() {
    let d = scratch("jsonl");
    let f = d.join("mixed.jsonl");
    let rows = [
        json!({"prompt": "2 + 2 =", "completion": " 4"}),
        json!({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}),
        json!({"messages": [{"role": "user", "content": "x", "name": null}, {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]}),
        json!({"prompt": [{"role": "user", "content": "q"}]}),
        json!({"messages": [{"role": "user", "content": "t"}], "tools": "[{\"type\": \"function\"}]"}),
        json!({"messages": [{"role": "user", "content": "t"}], "tools": [{"type": "function"}]}),
    ];
    std::fs::write(&f, rows.iter().map(|r| r.to_string()).collect::<Vec<_>>().join("\n\n")).unwrap();
    let ex = all(&Dataset::open(&f).unwrap());
    assert_eq!(
        ex[0],
        Example::PromptCompletion {
            prompt: json!("2 + 2 ="),
            completion: json!(" 4")
        }
    );
    assert_eq!(
        ex[1],
        Example::Conversation {
            messages: vec![
                json!({"role": "user", "content": "hi"}),
                json!({"role": "assistant", "content": "hello"})
            ],
            tools: None
        }
    );
    let Example::Conversation { messages: m, .. } = &ex[2] else {
        panic!()
    };
    assert!(m[0].get("name").is_none(), "nulls added by struct columns are dropped");
    assert!(
        m[1]["tool_calls"].is_array(),
        "an assistant turn with tool calls may have empty content"
    );
    assert!(matches!(&ex[3], Example::Prompt(p) if p.is_array()));
    for row in &ex[4..] {
        let Example::Conversation { tools, .. } = row else {
            panic!()
        };
        assert_eq!(
            tools,
            &Some(json!([{"type": "function"}])),
            "tools as JSON text or as a list"
        );
    }
    for (tools, why) in [
        (json!("[{"), "is not JSON"),
        (json!({"type": "function"}), "must be a list"),
    ] {
        let row = json!({"messages": [{"role": "user", "content": "t"}], "tools": tools});
        let err = Example::from_row(7, row.as_object().unwrap()).unwrap_err().to_string();
        assert!(
            err.contains("row 7") && err.contains("tools") && err.contains(why),
            "{err}"
        );
    }
}

#[test]
fn malformed_rows_are_named_or_skipped_and_counted() {
    let d = scratch("bad");
    let f = d.join("bad.jsonl");
    let rows = [
        json!({"messages": [{"role": "user", "content": "ok"}, {"role": "assistant", "content": "fine"}]}),
        json!({"text": "no usable column"}),
        json!({"messages": [{"role": "wizard", "content": "?"}]}),
        json!({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]}),
    ];
    std::fs::write(&f, rows.iter().map(|r| r.to_string()).collect::<Vec<_>>().join("\n")).unwrap();
    let ds = Dataset::open(&f).unwrap();
    let mut skipped = 0;
    let errs: Vec<String> = ds
        .examples(false, &mut skipped)
        .filter_map(|r| r.err())
        .map(|e| e.to_string())
        .collect();
    assert!(
        errs[0].starts_with("row 1 (0-based): field `messages` missing column"),
        "{errs:?}"
    );
    assert_eq!(
        errs[1],
        "row 2 (0-based): field `messages` message 0 has unknown role \"wizard\""
    );
    assert_eq!(
        errs[2],
        "row 3 (0-based): field `messages` message 1 is an empty assistant turn"
    );
    let kept: Vec<_> = ds.examples(true, &mut skipped).collect::<Result<_, _>>().unwrap();
    assert_eq!((kept.len(), skipped), (1, 3));
    std::fs::write(d.join("broken.jsonl"), "{\"messages\": [\n").unwrap();
    let err = Dataset::open(&d.join("broken.jsonl"))
        .unwrap()
        .rows()
        .next()
        .unwrap()
        .unwrap_err();
    assert!(
        matches!(err, DataError::File { .. }) && err.to_string().contains("broken.jsonl: line 1"),
        "{err}"
    );
    assert!(
        Dataset::open(&d.join("missing.parquet"))
            .unwrap_err()
            .to_string()
            .contains("no such file")
    );
    assert!(
        Dataset::open(&scratch("empty"))
            .unwrap_err()
            .to_string()
            .contains("holds no data file")
    );
}

/// A `messages` column of large types (what `datasets` writes for big tables).
fn large_messages_batch() -> RecordBatch {
    let fields = Fields::from(vec![
        Field::new("role", DataType::LargeUtf8, true),
        Field::new("content", DataType::LargeUtf8, true),
    ]);
    let roles = LargeStringArray::from(vec!["user", "assistant", "user", "assistant"]);
    let contents = LargeStringArray::from(vec!["a", "b", "c", "d"]);
    let structs = StructArray::new(
        fields.clone(),
        vec![Arc::new(roles) as ArrayRef, Arc::new(contents)],
        None,
    );
    let item = Arc::new(Field::new("item", DataType::Struct(fields), true));
    let list = LargeListArray::new(item, OffsetBuffer::from_lengths([2, 2]), Arc::new(structs), None);
    let schema = Arc::new(Schema::new(vec![Field::new(
        "messages",
        list.data_type().clone(),
        true,
    )]));
    RecordBatch::try_new(schema, vec![Arc::new(list)]).unwrap()
}

#[test]
fn arrow_ipc_streams_and_files_with_large_types() {
    let d = scratch("ipc");
    let batch = large_messages_batch();
    let stream = d.join("data-00000-of-00002.arrow");
    let mut w =
        arrow::ipc::writer::StreamWriter::try_new(std::fs::File::create(&stream).unwrap(), &batch.schema()).unwrap();
    w.write(&batch).unwrap();
    w.finish().unwrap();
    let file = d.join("data-00001-of-00002.arrow");
    let mut w =
        arrow::ipc::writer::FileWriter::try_new(std::fs::File::create(&file).unwrap(), &batch.schema()).unwrap();
    w.write(&batch).unwrap();
    w.finish().unwrap();
    std::fs::write(d.join("dataset_info.json"), "{}").unwrap();
    std::fs::write(d.join("state.json"), "{}").unwrap();
    let ds = Dataset::open(&d).unwrap();
    assert_eq!(ds.files.len(), 2, "metadata files are not data");
    let ex = all(&ds);
    assert_eq!(ex.len(), 4);
    assert_eq!(
        ex[3],
        Example::Conversation {
            messages: vec![
                json!({"role": "user", "content": "c"}),
                json!({"role": "assistant", "content": "d"})
            ],
            tools: None
        }
    );
}

#[test]
fn dataset_repos_resolve_in_the_hub_cache_by_split() {
    let root = scratch("hub");
    let repo = root.join("datasets--acme--tasks");
    let commit = "0123456789abcdef0123456789abcdef01234567";
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), commit).unwrap();
    let data = repo.join("snapshots").join(commit).join("data");
    std::fs::create_dir_all(&data).unwrap();
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("datasets/grpo");
    std::fs::copy(shipped.join("train.parquet"), data.join("train-00000-of-00001.parquet")).unwrap();
    std::fs::copy(shipped.join("test.parquet"), data.join("test-00000-of-00001.parquet")).unwrap();
    let cache = treetrain::hub::HubCache {
        root: root.clone(),
        offline: true,
    };
    assert_eq!(
        all(&Dataset::from_hub(&cache, "acme/tasks", Some("train")).unwrap()).len(),
        500
    );
    assert_eq!(
        all(&Dataset::from_hub(&cache, "acme/tasks", Some("test")).unwrap()).len(),
        100
    );
    // No split named: `load_dataset`'s training default, the train split.
    assert_eq!(all(&Dataset::from_hub(&cache, "acme/tasks", None).unwrap()).len(), 500);
    let err = Dataset::from_hub(&cache, "acme/tasks", Some("validation"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("no `validation` split; its splits: test, train"), "{err}");
    let err = Dataset::from_hub(&cache, "acme/other", None).unwrap_err().to_string();
    assert!(err.contains("`acme/other`") && err.contains("`main`"), "{err}");
}

/// The rows of `ds`, as JSON objects.
fn rows(ds: &Dataset) -> Vec<serde_json::Map<String, serde_json::Value>> {
    ds.rows().collect::<Result<_, _>>().unwrap()
}

/// Links are followed once, as `datasets.load_dataset` reads a folder: a second name for a
/// folder (`latest -> v1`) or a link back up (`again -> .`) adds no row. CSV and gzipped JSON
/// lines read as `load_dataset` reads them; a file of another kind is refused saying which
/// kinds are read.
#[test]
fn links_are_read_once_and_csv_and_gzipped_lines_are_read() {
    let dir = scratch("links");
    write_rows(&dir.join("v1"), "train.jsonl", 40);
    std::os::unix::fs::symlink("v1", dir.join("latest")).unwrap();
    std::os::unix::fs::symlink(".", dir.join("again")).unwrap();
    let once = Dataset::open(&dir).unwrap();
    // `again` leads back to the folder being read; `latest` is the first name of `v1`.
    assert_eq!(once.files, [dir.join("latest/train.jsonl")], "{:?}", once.files);
    assert_eq!(rows(&once).len(), 40);
    // CSV: a header, numbers inferred as numbers, text kept as written.
    let csv = dir.join("table.csv");
    std::fs::write(&csv, "prompt,answer,score\n2+2=,4,0.5\n\"a, b\",02134,1.0\n").unwrap();
    let got = rows(&Dataset::open(&csv).unwrap());
    assert_eq!(got.len(), 2);
    assert_eq!(got[0]["prompt"], "2+2=");
    assert_eq!(got[1]["prompt"], "a, b");
    assert_eq!(got[0]["answer"], 4);
    assert_eq!(got[1]["score"], 1.0);
    // Gzipped JSON lines equal the plain file's rows.
    let plain = std::fs::read(dir.join("v1/train.jsonl")).unwrap();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    std::io::Write::write_all(&mut gz, &plain).unwrap();
    let zipped = dir.join("zipped.jsonl.gz");
    std::fs::write(&zipped, gz.finish().unwrap()).unwrap();
    assert_eq!(
        rows(&Dataset::open(&zipped).unwrap()),
        rows(&Dataset::open(&dir.join("v1/train.jsonl")).unwrap())
    );
    let text = dir.join("notes.txt");
    std::fs::write(&text, "hello\n").unwrap();
    let err = Dataset::open(&text)
        .and_then(|d| d.rows().collect::<Result<Vec<_>, _>>())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("is not a data file treetrain reads") && err.contains(".jsonl.gz"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
