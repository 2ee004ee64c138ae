//! kvd's own ZMTP implementation against another one: the `zeromq` crate's DEALER, and a REQ
//! socket, speak to kvd's ROUTER and get protocol replies. (The Python tests do the same with
//! libzmq through pyzmq.)

mod common;

use bytes::Bytes;
use common::*;
use kvd_proto::wire::*;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

async fn ask<S: SocketSend + SocketRecv>(sock: &mut S, id: u64, req: &Request) -> (u64, Reply) {
    sock.send(ZmqMessage::from(encode_request(id, req).to_vec()))
        .await
        .unwrap();
    let msg = tokio::time::timeout(std::time::Duration::from_secs(5), sock.recv())
        .await
        .expect("reply")
        .unwrap();
    let frame: Bytes = msg.into_vec().pop().unwrap();
    decode_reply(&frame, 1 << 20).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zeromq_crate_dealer_and_req_talk_to_kvd() {
    let kvd = InProcess::ready(&[]);
    let hello = Request::Hello(Hello {
        protocol_version: PROTOCOL_VERSION as u16,
        client: "zmq.rs".into(),
        pid: 1,
        role: Role::Tool,
    });

    let mut dealer = zeromq::DealerSocket::new();
    dealer.connect(&kvd.zmq).await.unwrap();
    let (id, reply) = ask(&mut dealer, 1, &hello).await;
    assert_eq!(id, 1);
    let Reply::Hello(h) = reply else {
        panic!("{reply:?}")
    };
    assert_eq!(h.protocol_version, PROTOCOL_VERSION as u16);
    let (id, reply) = ask(&mut dealer, 2, &Request::Ping(Ping {})).await;
    assert_eq!(id, 2);
    assert!(matches!(reply, Reply::Pong(_)));

    let mut req = zeromq::ReqSocket::new();
    req.connect(&kvd.zmq).await.unwrap();
    let (_, reply) = ask(&mut req, 3, &hello).await;
    assert!(matches!(reply, Reply::Hello(_)));
    let (_, reply) = ask(&mut req, 4, &Request::Stats(StatsRequest {})).await;
    let Reply::Stats(s) = reply else {
        panic!("{reply:?}")
    };
    assert_eq!(s.sessions, 2);
}
