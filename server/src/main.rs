//! `kvd`: parse flags, set up logging, run the server until SIGTERM or SIGINT.
#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::error::ErrorKind;
use clap::{CommandFactory, Parser};
use kvd_server::life::config::LogFormat;
use kvd_server::life::flags::{Cli, Command};
use kvd_server::life::machine::Machine;

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e)
            if matches!(
                e.kind(),
                ErrorKind::DisplayHelp
                    | ErrorKind::DisplayVersion
                    | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            ) =>
        {
            let _ = e.print();
            return if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                ExitCode::from(2)
            } else {
                ExitCode::SUCCESS
            };
        }
        Err(e) => {
            let argv: Vec<String> = std::env::args().skip(1).collect();
            refuse(json_in_argv(&argv), &usage_error(&e, &argv));
            return ExitCode::from(2);
        }
    };
    let Command::Serve(args) = cli.command;
    // Known before the flags are checked, so that their errors are JSON too.
    let json = args.log_format == "json";
    // Before probing: the connection and descriptor limits are sized from the raised limit.
    let raised = raise_fd_limit();
    let machine = Machine::probe();
    let config = match args.resolve(&machine) {
        Ok(c) => c,
        Err(e) => {
            refuse(json, &e.to_string());
            return ExitCode::from(2);
        }
    };
    let logs = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(&config.log_level))
        .with_writer(std::io::stderr);
    match config.log_format {
        LogFormat::Text => logs
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
        LogFormat::Json => logs.json().init(),
    }
    tracing::info!("kvd {} starting", env!("CARGO_PKG_VERSION"));
    match raised {
        Ok(Some(msg)) => tracing::debug!("{msg}"),
        Ok(None) => {}
        Err(msg) => tracing::warn!("{msg}"),
    }
    tracing::info!(
        "open-file limit {}: up to {} ZMQ connections, {} fd-socket connections, {} unclaimed descriptors",
        machine.open_files,
        config.max_connections,
        config.fd_limits.max_connections,
        config.fd_limits.max_stashed
    );

    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(machine.cpus.clamp(2, 8))
        .thread_name("kvd-rt")
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            refuse(json, &format!("cannot start the async runtime: {e}"));
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        let gpu = kvd_server::data::devices::discover_gpu();
        kvd_server::life::server::serve(config, gpu, shutdown_signal()).await
    });
    // Blocking threads (a stuck driver call) must not hold the exit past the drain deadline.
    runtime.shutdown_timeout(std::time::Duration::from_millis(500));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            refuse(json, &e.to_string());
            ExitCode::FAILURE
        }
    }
}

/// Says why kvd will not run, once: `kvd: WHY` on stderr, or under `--log-format json` an
/// ERROR record shaped like every other log line, so a log shipper parses this one too. (Its
/// own subscriber: the error is printed whatever `--log-level` filters.)
fn refuse(json: bool, why: &str) {
    if json {
        let once = tracing_subscriber::fmt()
            .json()
            .with_writer(std::io::stderr)
            .finish();
        tracing::subscriber::with_default(once, || tracing::error!("{why}"));
    } else {
        eprintln!("kvd: {why}");
    }
}

/// Whether the command line asks for JSON logs (its last `--log-format`, as clap would take
/// it), for errors found before the flags could be parsed.
fn json_in_argv(argv: &[String]) -> bool {
    let mut json = false;
    let mut words = argv.iter();
    while let Some(w) = words.next() {
        if w == "--log-format" {
            json = words.next().is_some_and(|v| v == "json");
        } else if let Some(v) = w.strip_prefix("--log-format=") {
            json = v == "json";
        }
    }
    json
}

/// One line for a command line clap refused: its first line, which names the argument, and
/// where to look — `kvd serve --help` for serve's flags, else kvd's subcommands.
fn usage_error(e: &clap::Error, argv: &[String]) -> String {
    let text = e.render().to_string();
    let first = text
        .lines()
        .next()
        .unwrap_or("bad arguments")
        .trim_start_matches("error: ");
    if argv.first().is_some_and(|a| a == "serve") && e.kind() != ErrorKind::InvalidSubcommand {
        return format!("{first}; see kvd serve --help");
    }
    let subcommands: Vec<String> = Cli::command()
        .get_subcommands()
        .map(|c| match c.get_about() {
            Some(about) => format!(
                "{} ({})",
                c.get_name(),
                about.to_string().trim_end_matches('.').to_lowercase()
            ),
            None => c.get_name().to_string(),
        })
        .collect();
    format!(
        "{first}; kvd's subcommands: {}; see kvd --help",
        subcommands.join(", ")
    )
}

/// VMM registrations pass one descriptor per 20 MiB chunk, thousands per GPU: lift the soft
/// limit on open files to the hard one. Returns what to log once logging is set up.
fn raise_fd_limit() -> Result<Option<String>, String> {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut lim = getrlimit(Resource::Nofile);
    if lim.current < lim.maximum {
        let from = lim.current;
        lim.current = lim.maximum;
        return match setrlimit(Resource::Nofile, lim) {
            Ok(()) => Ok(Some(format!("open-file limit raised from {from:?} to {:?}", lim.maximum))),
            Err(e) => Err(format!("could not raise the open-file limit ({e}); VMM registrations may run out of descriptors")),
        };
    }
    Ok(None)
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (mut term, mut int) = match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(t), Ok(i)) => (t, i),
        _ => {
            tracing::error!("cannot install signal handlers; stop kvd with SIGKILL");
            return std::future::pending().await;
        }
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received"),
        _ = int.recv() => tracing::info!("SIGINT received"),
    }
}
