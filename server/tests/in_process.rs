//! A kvd started in-process: `server::bind` on port 0, the test reading where it listens from
//! `Listening::bound` instead of a child's log, then `Listening::serve` until the test stops it.

use clap::Parser;
use kvd_proto::client::{Client, ClientConfig};
use kvd_proto::wire::{Ping, Role};
use kvd_proto::zmtp::Endpoint;
use kvd_server::life::flags::{Cli, Command};
use kvd_server::life::machine::Machine;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_bound_in_process_answers_and_stops_when_told() {
    let fd_socket =
        std::env::temp_dir().join(format!("kvd-in-process-{}.sock", std::process::id()));
    let cli = Cli::try_parse_from([
        "kvd",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--http-host",
        "127.0.0.1",
        "--http-port",
        "0",
        "--l1-size-gb",
        "0.0625",
        "--fd-socket",
        fd_socket.to_str().unwrap(),
    ])
    .unwrap();
    let Command::Serve(args) = cli.command;
    let config = args.resolve(&Machine::probe()).unwrap();
    let listening = kvd_server::life::server::bind(config).await.unwrap();
    let port = listening
        .bound()
        .zmq
        .iter()
        .find_map(|e| match e {
            Endpoint::Tcp { port, .. } => Some(*port),
            _ => None,
        })
        .expect("a TCP endpoint");
    assert_ne!(port, 0, "bound reports the port the OS picked");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(listening.serve(Err("no GPU in this test".into()), async {
        let _ = stopped.await;
    }));
    let client = Client::connect(ClientConfig::new(
        format!("tcp://127.0.0.1:{port}"),
        "in-process",
        Role::Tool,
    ))
    .await
    .unwrap();
    client.ping(Ping {}).await.unwrap();
    drop(client);
    stop.send(()).unwrap();
    server.await.unwrap().unwrap();
    assert!(
        !fd_socket.exists(),
        "serve removes its fd socket on the way out"
    );
}
