//! The AFL++ harness: `kvd-fuzz TARGET` under `afl-fuzz` (persistent mode); `kvd-fuzz seeds
//! TARGET DIR` writes the target's starting inputs; `kvd-fuzz replay TARGET FILE...` runs inputs
//! once, for triage.

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = || {
        let names: Vec<_> = kvd_fuzz::TARGETS.iter().map(|(n, _)| *n).collect();
        eprintln!(
            "usage: kvd-fuzz TARGET | seeds TARGET DIR | replay TARGET FILE...; targets: {}",
            names.join(", ")
        );
        ExitCode::from(2)
    };
    match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["seeds", name, dir] => {
            if kvd_fuzz::target(name).is_none() {
                return usage();
            }
            for (i, s) in kvd_fuzz::seeds::seeds(name).iter().enumerate() {
                let path = std::path::Path::new(dir).join(format!("seed-{i:03}"));
                if let Err(e) = std::fs::write(&path, s) {
                    eprintln!("kvd-fuzz: cannot write {}: {e}", path.display());
                    return ExitCode::FAILURE;
                }
            }
            ExitCode::SUCCESS
        }
        ["replay", name, ref files @ ..] => {
            let Some(t) = kvd_fuzz::target(name) else {
                return usage();
            };
            for f in files {
                match std::fs::read(f) {
                    Ok(data) => t(&data),
                    Err(e) => {
                        eprintln!("kvd-fuzz: cannot read {f}: {e}");
                        return ExitCode::FAILURE;
                    }
                }
            }
            ExitCode::SUCCESS
        }
        [name] => {
            let Some(t) = kvd_fuzz::target(name) else {
                return usage();
            };
            afl::fuzz!(|data: &[u8]| t(data));
            ExitCode::SUCCESS
        }
        _ => usage(),
    }
}
