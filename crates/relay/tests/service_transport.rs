//! The relay's connections: the cap of calls per connection, resets, vanished and slow
//! peers, binding, graceful shutdown (`tests/relay/test_transport.py`).
#![allow(clippy::unwrap_used)]

mod service_support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use static_relay::pb;
use tokio::net::TcpStream;
use tonic::Code;

use service_support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binds_only_the_configured_host() {
    let relay = Relay::anonymous().await;
    assert!(relay.addr.ip().is_loopback());
    assert!(TcpStream::connect(("127.0.0.2", relay.addr.port()))
        .await
        .is_err());
    // The port is taken: another listener cannot share it.
    assert!(std::net::TcpListener::bind(relay.addr).is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keepalives_flow_on_an_idle_subscription() {
    let relay = Relay::start(|c| {
        c.allow_anonymous = true;
        c.keepalive_interval = Duration::from_millis(100);
    })
    .await;
    let mut client = relay.client().await;
    create(&mut client, CHANNEL).await;
    let started = Instant::now();
    let mut sub = Subscription::open(&mut client, subscribe_request(CHANNEL, 0)).await;
    sub.wait_keepalives(6).await;
    assert!(started.elapsed() < Duration::from_secs(2));
    assert!(sub.entries.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_per_connection_are_capped() {
    let relay = Relay::start(|c| {
        c.allow_anonymous = true;
        c.max_streams_per_connection = 3;
        c.keepalive_interval = Duration::from_secs(60);
    })
    .await;
    let mut client = relay.client().await;
    create(&mut client, CHANNEL).await;
    let mut subs = Subscription::open_live(&mut client, CHANNEL, 3).await;
    let refused = publish(&mut client, CHANNEL, application(CHANNEL, 0, b"x"))
        .await
        .unwrap_err();
    assert_status(
        &refused,
        Code::ResourceExhausted,
        "too many concurrent streams on this connection (limit 3)",
    );
    // Another connection is not affected.
    let mut other = relay.client().await;
    assert_eq!(
        publish(&mut other, CHANNEL, application(CHANNEL, 0, b"x"))
            .await
            .unwrap()
            .seq,
        1
    );
    for sub in &mut subs {
        sub.wait_for(1).await;
    }
    // A cancelled call frees its place at once, without traffic on it (keep-alives are
    // minutes apart here): its RST_STREAM is enough.
    for _ in 0..20 {
        subs.pop();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut sub = Subscription::open(&mut client, subscribe_request(CHANNEL, 0)).await;
        sub.wait_keepalives(1).await;
        subs.push(sub);
    }
}

/// A bare HTTP/2 connection (the h2 crate), for what a gRPC client never does.
async fn raw_connection(
    relay: &Relay,
) -> (
    h2::client::SendRequest<Bytes>,
    tokio::task::JoinHandle<Result<(), h2::Error>>,
) {
    let tcp = TcpStream::connect(relay.addr).await.unwrap();
    tcp.set_nodelay(true).unwrap();
    let (send, connection) = h2::client::handshake(tcp).await.unwrap();
    (send, tokio::spawn(connection))
}

fn grpc_request(method: &str) -> http::Request<()> {
    http::Request::builder()
        .method("POST")
        .uri(format!("http://relay/static.relay.v1.Relay/{method}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap()
}

fn grpc_frame(message: &impl prost::Message) -> Bytes {
    let body = message.encode_to_vec();
    let mut frame = vec![0u8];
    frame.extend_from_slice(&u32::try_from(body.len()).unwrap().to_be_bytes());
    frame.extend_from_slice(&body);
    Bytes::from(frame)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vanished_subscriber_is_noticed_without_traffic() {
    let relay = Relay::start_with(
        |c| c.keepalive_interval = Duration::from_secs(60),
        Some(Arc::new(FakeVerify)),
    )
    .await;
    let mut client = relay.client().await;
    create_as(&mut client, CHANNEL, "acme.k1").await;
    let (mut send, connection) = raw_connection(&relay).await;
    let mut request = grpc_request("Subscribe");
    request
        .headers_mut()
        .insert("authorization", "Bearer acme.gone".parse().unwrap());
    let (response, mut body) = send.send_request(request, false).unwrap();
    body.send_data(grpc_frame(&subscribe_request(CHANNEL, 0)), true)
        .unwrap();
    let mut response = within("the response headers", response)
        .await
        .unwrap()
        .into_body();
    let keepalive = within("a keep-alive", response.data()).await;
    assert!(keepalive.unwrap().is_ok(), "no keep-alive");
    assert_eq!(relay.server().live_keys(), ["gone"]);
    // Gone: no RST_STREAM, no GOAWAY, the socket just closes.
    connection.abort();
    drop((send, response));
    let deadline = Instant::now() + Duration::from_secs(3);
    while !relay.server().live_keys().is_empty() {
        assert!(
            Instant::now() < deadline,
            "the subscription outlived its connection"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rapid_reset_flood_is_cut_off() {
    let relay = Relay::anonymous().await;
    let mut client = relay.client().await;
    create(&mut client, CHANNEL).await;
    let mut sub = Subscription::open(&mut client, subscribe_request(CHANNEL, 0)).await;
    sub.wait_keepalives(1).await;
    for round in 0..3u64 {
        let (mut send, connection) = raw_connection(&relay).await;
        let mut cut_off = false;
        for _ in 0..3000 {
            let ready = tokio::time::timeout(Duration::from_secs(5), send.ready()).await;
            send = match ready {
                Ok(Ok(send)) => send,
                _ => {
                    cut_off = true;
                    break;
                }
            };
            let Ok((_, mut body)) = send.send_request(grpc_request("Subscribe"), false) else {
                cut_off = true;
                break;
            };
            let _ = body.send_data(grpc_frame(&subscribe_request(CHANNEL, 0)), true);
            body.send_reset(h2::Reason::CANCEL);
        }
        if !cut_off {
            let ended = tokio::time::timeout(Duration::from_secs(3), connection).await;
            cut_off = ended.is_ok();
        }
        assert!(cut_off, "the flooding connection was not closed");
        // Everyone else is unaffected.
        let message = application(CHANNEL, 0, round.to_string().as_bytes());
        assert_eq!(
            publish(&mut client, CHANNEL, message).await.unwrap().seq,
            round + 1
        );
    }
    // Resets of calls already being served count too (the relay's own budget: a burst of
    // 200, then 50 a second).
    let (mut send, connection) = raw_connection(&relay).await;
    let mut cut_off = false;
    for _ in 0..400 {
        let Ok(Ok(ready)) = tokio::time::timeout(Duration::from_secs(5), send.ready()).await else {
            cut_off = true;
            break;
        };
        send = ready;
        let Ok((response, mut body)) = send.send_request(grpc_request("Subscribe"), false) else {
            cut_off = true;
            break;
        };
        let _ = body.send_data(grpc_frame(&subscribe_request(CHANNEL, 0)), true);
        // Served: its response headers came.
        if tokio::time::timeout(Duration::from_secs(5), response)
            .await
            .map_or(true, |r| r.is_err())
        {
            cut_off = true;
            break;
        }
        body.send_reset(h2::Reason::CANCEL);
    }
    if !cut_off {
        cut_off = tokio::time::timeout(Duration::from_secs(3), connection)
            .await
            .is_ok();
    }
    assert!(
        cut_off,
        "the connection resetting served calls was not closed"
    );
    let message = application(CHANNEL, 0, b"after");
    assert_eq!(publish(&mut client, CHANNEL, message).await.unwrap().seq, 4);
    sub.wait_for(4).await;
    assert_eq!(sub.seqs(), [1, 2, 3, 4]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_subscriber_stalls_nobody_and_catches_up() {
    let relay = Relay::anonymous().await;
    let mut client = relay.client().await;
    create(&mut client, CHANNEL).await;
    let (count, payload) = (1500u64, vec![b'x'; 1024]);
    // Opened, then not read until the end (on a connection of its own).
    let mut slow_client = relay.client().await;
    let mut slow = Subscription::open(&mut slow_client, subscribe_request(CHANNEL, 0)).await;
    let mut fast = Subscription::open(&mut client, subscribe_request(CHANNEL, 0)).await;
    fast.wait_keepalives(1).await;
    let started = Instant::now();
    for start in (0..count).step_by(100) {
        let requests: Vec<_> = (start..start + 100)
            .map(|i| {
                let mut body = payload.clone();
                body.extend_from_slice(i.to_string().as_bytes());
                request(CHANNEL, application(CHANNEL, 0, &body))
            })
            .collect();
        let mut answers = client
            .publish_stream(tokio_stream::iter(requests))
            .await
            .unwrap()
            .into_inner();
        all_answers(&mut answers).await;
    }
    fast.wait_for(count as usize).await;
    assert_eq!(fast.seqs(), (1..=count).collect::<Vec<_>>());
    assert!(started.elapsed() < Duration::from_secs(20));
    slow.wait_for(count as usize).await;
    assert_eq!(slow.seqs(), (1..=count).collect::<Vec<_>>());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_ends_streams_cleanly() {
    let mut relay = Relay::start(|c| {
        c.allow_anonymous = true;
        c.graceful_timeout = Duration::from_secs(5);
    })
    .await;
    let mut client = relay.client().await;
    create(&mut client, CHANNEL).await;
    let mut subs = Subscription::open_live(&mut client, CHANNEL, 3).await;
    // A PublishBatches call left open (as the SDK keeps one) does not hold the drain up.
    let (batches_tx, batches_rx) = tokio::sync::mpsc::channel::<pb::PublishBatchRequest>(1);
    let mut batches = client
        .publish_batches(tokio_stream::wrappers::ReceiverStream::new(batches_rx))
        .await
        .unwrap()
        .into_inner();
    let started = Instant::now();
    let server = relay.server.take().unwrap();
    let stopping = tokio::spawn(server.shutdown());
    for sub in &mut subs {
        let status = sub.wait_end().await;
        assert_eq!(
            (status.code(), status.message()),
            (Code::Unavailable, "relay is shutting down")
        );
    }
    let status = next_answer(&mut batches).await.unwrap_err();
    assert_eq!(
        (status.code(), status.message()),
        (Code::Unavailable, "relay is shutting down")
    );
    drop(batches_tx);
    tokio::time::timeout(Duration::from_secs(10), stopping)
        .await
        .unwrap()
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    // Nobody listens any more.
    assert!(TcpStream::connect(relay.addr).await.is_err());
}

/// An HTTP/2 frame.
fn h2_frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = u32::try_from(payload.len()).unwrap().to_be_bytes()[1..].to_vec();
    out.extend_from_slice(&[kind, flags]);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// An HPACK literal header field, not indexed, new name, no Huffman coding.
fn hpack_literal(block: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    block.push(0);
    for part in [name, value] {
        block.push(u8::try_from(part.len()).unwrap());
        block.extend_from_slice(part);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn illegal_header_values_never_reach_the_service() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let relay = Relay::anonymous().await;
    // Written by hand: HTTP libraries refuse to send a control character in a header.
    let mut tcp = TcpStream::connect(relay.addr).await.unwrap();
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    out.extend(h2_frame(4, 0, 0, &[])); // SETTINGS
    let mut block = vec![0x83, 0x86]; // :method POST, :scheme http
    let path = b"/static.relay.v1.Relay/CreateChannel";
    block.extend_from_slice(&[0x04, u8::try_from(path.len()).unwrap()]);
    block.extend_from_slice(path);
    hpack_literal(&mut block, b"content-type", b"application/grpc");
    hpack_literal(&mut block, b"te", b"trailers");
    hpack_literal(&mut block, b"authorization", b"Bearer ab\x01cd");
    out.extend(h2_frame(1, 0x4, 1, &block)); // HEADERS, END_HEADERS
    let body = grpc_frame(&pb::CreateChannelRequest {
        channel: CHANNEL.into(),
        ..Default::default()
    });
    out.extend(h2_frame(0, 0x1, 1, &body)); // DATA, END_STREAM
    tcp.write_all(&out).await.unwrap();
    let mut received = Vec::new();
    let mut buf = vec![0u8; 65536];
    while let Ok(Ok(n @ 1..)) =
        tokio::time::timeout(Duration::from_secs(2), tcp.read(&mut buf)).await
    {
        received.extend_from_slice(&buf[..n]);
    }
    // h2 refuses the header block: GOAWAY(PROTOCOL_ERROR), the call never started.
    let mut kinds = Vec::new();
    let mut pos = 0;
    while pos + 9 <= received.len() {
        let len = usize::from(received[pos]) << 16
            | usize::from(received[pos + 1]) << 8
            | usize::from(received[pos + 2]);
        kinds.push((
            received[pos + 3],
            received.get(pos + 9..pos + 9 + len).map(<[u8]>::to_vec),
        ));
        pos += 9 + len;
    }
    let goaway = kinds
        .iter()
        .find(|(kind, _)| *kind == 7)
        .expect("no GOAWAY");
    assert_eq!(
        goaway.1.as_deref().map(|p| &p[4..8]),
        Some(&[0u8, 0, 0, 1][..])
    );
    assert!(
        kinds.iter().all(|(kind, _)| *kind != 1),
        "a response to the call"
    );
    // Nothing was created; the server is fine.
    let mut client = relay.client().await;
    create(&mut client, CHANNEL).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taken_port_is_an_error() {
    let relay = Relay::anonymous().await;
    let mut config = static_relay::RelayConfig::new(relay.dir.path().join("static.db"));
    config.port = relay.addr.port();
    let Err(error) = static_relay::RelayServer::start(config, None).await else {
        panic!("a second relay on the same port");
    };
    assert_eq!(error.code(), Code::Unavailable);
    assert!(
        error.to_string().starts_with("cannot listen on 127.0.0.1:"),
        "{error}"
    );
}

/// Whether the relay closes `tcp` within a few seconds (reads until the end; what it sent
/// before, e.g. its SETTINGS and GOAWAY, is skipped).
async fn closed_by_the_relay(tcp: &mut TcpStream) -> bool {
    use tokio::io::AsyncReadExt;
    let mut buf = vec![0u8; 4096];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        match tokio::time::timeout_at(deadline, tcp.read(&mut buf)).await {
            Ok(Ok(0) | Err(_)) => return true,
            Ok(Ok(_)) => {}
            Err(_) => return false,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_without_calls_are_closed_after_the_idle_timeout() {
    use tokio::io::AsyncWriteExt;
    let idle = Duration::from_millis(400);
    let relay = Relay::start(|c| {
        c.allow_anonymous = true;
        c.idle_timeout = idle;
        c.keepalive_interval = Duration::from_millis(100);
    })
    .await;
    // A subscription on a connection of its own: live calls keep it open.
    let mut client = relay.client().await;
    create(&mut client, CHANNEL).await;
    let mut sub = Subscription::open(&mut client, subscribe_request(CHANNEL, 0)).await;
    sub.wait_keepalives(1).await;
    let started = Instant::now();
    let mut silent = TcpStream::connect(relay.addr).await.unwrap();
    let mut preface = TcpStream::connect(relay.addr).await.unwrap();
    preface
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .unwrap();
    let mut settings = TcpStream::connect(relay.addr).await.unwrap();
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    out.extend(h2_frame(4, 0, 0, &[])); // SETTINGS, then nothing
    settings.write_all(&out).await.unwrap();
    // A real HTTP/2 client (it answers PINGs) that makes one call, then none.
    let (mut send, connection) = raw_connection(&relay).await;
    let (response, _) = send
        .send_request(grpc_request("ListMembers"), true)
        .unwrap();
    within("an answer", response).await.unwrap();
    for (what, tcp) in [
        ("silent", &mut silent),
        ("preface only", &mut preface),
        ("preface and SETTINGS", &mut settings),
    ] {
        assert!(
            closed_by_the_relay(tcp).await,
            "a {what} connection stayed open"
        );
    }
    let ended = tokio::time::timeout(Duration::from_secs(5), connection).await;
    assert!(ended.is_ok(), "a connection whose call is done stayed open");
    assert!(started.elapsed() >= idle, "closed before the idle timeout");
    // The subscription's connection was never idle: it flows, and serves calls.
    tokio::time::sleep(idle * 2).await;
    let keepalives = sub.keepalives;
    sub.wait_keepalives(keepalives + 2).await;
    let message = application(CHANNEL, 0, b"still here");
    assert_eq!(publish(&mut client, CHANNEL, message).await.unwrap().seq, 1);
    sub.wait_for(1).await;
}

/// A connection from `local` (a loopback address) that the relay serves: None when it closed
/// it instead. The connection stays open while the returned handles live.
async fn served_from(
    relay: &Relay,
    local: &str,
) -> Option<(
    h2::client::SendRequest<Bytes>,
    tokio::task::JoinHandle<Result<(), h2::Error>>,
)> {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(format!("{local}:0").parse().unwrap()).unwrap();
    let tcp = socket.connect(relay.addr).await.unwrap();
    let (mut send, connection) = h2::client::handshake(tcp).await.ok()?;
    let connection = tokio::spawn(connection);
    let (response, _) = send.send_request(grpc_request("ListMembers"), true).ok()?;
    match tokio::time::timeout(Duration::from_secs(5), response).await {
        Ok(Ok(_)) => Some((send, connection)),
        Ok(Err(_)) => None,
        Err(_) => panic!("neither served nor closed"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_are_capped_overall_and_per_address() {
    let relay = Relay::start(|c| {
        c.allow_anonymous = true;
        c.max_connections = 3;
        c.max_connections_per_address = 2;
    })
    .await;
    let mut first = served_from(&relay, "127.0.0.1").await.expect("the 1st");
    let _second = served_from(&relay, "127.0.0.1").await.expect("the 2nd");
    assert!(
        served_from(&relay, "127.0.0.1").await.is_none(),
        "a 3rd connection from one address"
    );
    let _third = served_from(&relay, "127.0.0.2")
        .await
        .expect("another address");
    assert!(
        served_from(&relay, "127.0.0.3").await.is_none(),
        "a 4th connection overall"
    );
    // A refused connection was closed at once; a served one gives its place back as it ends.
    let (response, _) = first
        .0
        .send_request(grpc_request("ListMembers"), true)
        .unwrap();
    within("an answer on a served connection", response)
        .await
        .unwrap();
    drop(first.0);
    first.1.abort();
    let deadline = Instant::now() + Duration::from_secs(5);
    let _again = loop {
        if let Some(served) = served_from(&relay, "127.0.0.3").await {
            break served;
        }
        assert!(
            Instant::now() < deadline,
            "a closed connection kept its place"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
}
