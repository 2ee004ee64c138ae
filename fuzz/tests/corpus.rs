//! Replays each target's committed corpus (`fuzz/corpus/TARGET/`, minimized by
//! `scripts/fuzz.sh`) and every input that once broke an invariant (`fuzz/regressions/TARGET/`),
//! so CI checks all that the fuzzer learnt without running it.

use std::path::{Path, PathBuf};

fn inputs(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
}

#[test]
fn every_target_passes_its_corpus_and_regressions() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for &(name, target) in kvd_fuzz::TARGETS {
        let corpus = inputs(&root.join("corpus").join(name));
        assert!(
            corpus.len() >= 2,
            "fuzz/corpus/{name} holds {} inputs; run scripts/fuzz.sh {name} to grow it",
            corpus.len()
        );
        let regressions = inputs(&root.join("regressions").join(name));
        for path in corpus.iter().chain(&regressions) {
            let data = std::fs::read(path).expect("a readable input");
            if std::panic::catch_unwind(|| target(&data)).is_err() {
                panic!("{name}: {} breaks an invariant", path.display());
            }
        }
        println!(
            "{name}: {} corpus inputs, {} regressions",
            corpus.len(),
            regressions.len()
        );
    }
}

#[test]
fn seeds_pass_their_targets() {
    for &(name, target) in kvd_fuzz::TARGETS {
        let seeds = kvd_fuzz::seeds::seeds(name);
        assert!(!seeds.is_empty(), "{name} has no seeds");
        for s in &seeds {
            target(s);
        }
    }
}
