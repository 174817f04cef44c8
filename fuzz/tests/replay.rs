//! Replays every kept fuzz input through the same checks the fuzz targets run: the corpora
//! (`fuzz/corpus/<target>/`, grown and minimised by `make fuzz`) and every input that ever
//! crashed a target (`fuzz/regressions/<target>/`, one file per crash, named after what it
//! found). Runs on stable in the normal test suite; a regression fails here without fuzzing.

#![allow(clippy::unwrap_used, clippy::panic)]
use std::path::{Path, PathBuf};

fn inputs(dir: &Path) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut v: Vec<PathBuf> = rd
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file() && p.file_name().is_some_and(|n| n != "README.md"))
        .collect();
    v.sort();
    v
}

fn replay(kind: &str, min_files: usize) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join(kind);
    let mut total = 0;
    for (name, check) in kvroute_fuzz::TARGETS {
        let files = inputs(&root.join(name));
        for f in &files {
            let data = std::fs::read(f).unwrap();
            if std::panic::catch_unwind(|| check(&data)).is_err() {
                panic!("{name}: {} fails its check", f.display());
            }
        }
        if kind == "corpus" {
            assert!(
                files.len() >= min_files,
                "{name}: {} corpus entries, expected at least {min_files}",
                files.len()
            );
        }
        total += files.len();
    }
    eprintln!("{kind}: {total} inputs replayed");
}

#[test]
fn every_corpus_entry_passes() {
    replay("corpus", 3);
}

#[test]
fn every_past_crash_stays_fixed() {
    replay("regressions", 0);
}
