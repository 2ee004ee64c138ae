//! The in-process harness itself (`common::InProcess`): a kvd bound in this process on port 0
//! reports the port the OS picked, answers, and when stopped drains and removes its socket
//! files as the binary does on SIGTERM.

mod common;

use common::*;
use kvd_proto::wire::Ping;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_bound_in_process_answers_and_stops_when_told() {
    let kvd = InProcess::start(&["--l1-size-gb", "0.0625"]);
    let port: u16 = kvd.zmq.rsplit(':').next().unwrap().parse().unwrap();
    assert_ne!(port, 0, "bound reports the port the OS picked");
    assert_ne!(kvd.http.port(), 0);
    let client = kvd.client("in-process").await;
    client.ping(Ping {}).await.unwrap();
    drop(client);
    let fd_socket = kvd.fd_socket.clone();
    assert!(fd_socket.exists());
    tokio::task::spawn_blocking(move || kvd.stop())
        .await
        .unwrap()
        .unwrap();
    assert!(
        !fd_socket.exists(),
        "serve removes its fd socket on the way out"
    );
}
