//! The request-part extractors (`Header`, `Path`, `Method`, `Global`,
//! `PeerIp`), tuples and `.or()` chains on arbitrary names, values, methods
//! and URIs; and `KeyBuf` itself (length prefixes, hashing, mark/reset).
#![no_main]

use std::net::{IpAddr, SocketAddr};

use arbitrary::Arbitrary;
use http::header::{HeaderName, HeaderValue};
use http::{Method as HttpMethod, Request, Uri};
use libfuzzer_sys::fuzz_target;
use tollgate::key::{
    Global, Header, KeyBuf, KeyExtractor, KeyExtractorExt, Method, Or, Path, PeerIp, MAX_RAW_KEY,
};

#[derive(Debug, Arbitrary)]
struct Input {
    method: Vec<u8>,
    uri: Vec<u8>,
    headers: Vec<(Vec<u8>, Vec<u8>)>,
    /// Values for the well-known key headers.
    api_key: Option<Vec<u8>>,
    user: Option<Vec<u8>>,
    peer: Option<(IpAddr, u16)>,
    /// A configured header name (must be a config error or work).
    configured: String,
    /// Raw `KeyBuf` parts: pushed, marked, rolled back.
    parts: Vec<Vec<u8>>,
    mark_at: u8,
}

fn finish(key: &mut KeyBuf) -> Vec<u8> {
    let bytes = key.as_bytes().to_vec();
    assert!(
        bytes.len() <= MAX_RAW_KEY || (bytes.len() == 33 && bytes[0] == 0xff),
        "key of {} bytes",
        bytes.len()
    );
    // Finishing is idempotent.
    assert_eq!(key.as_bytes(), &bytes[..]);
    bytes
}

fn run<E: KeyExtractor<()>>(e: &E, req: &Request<()>) -> Option<Vec<u8>> {
    let mut key = KeyBuf::new();
    let got = e.extract(req, &mut key).map(|()| finish(&mut key));
    // Deterministic.
    let mut again = KeyBuf::new();
    let again = e.extract(req, &mut again).map(|()| finish(&mut again));
    assert_eq!(got, again);
    got
}

fuzz_target!(|input: Input| {
    let mut req = Request::builder().body(()).unwrap();
    if let Ok(m) = HttpMethod::from_bytes(&input.method) {
        *req.method_mut() = m;
    }
    if let Ok(u) = Uri::try_from(input.uri.as_slice()) {
        *req.uri_mut() = u;
    }
    for (name, value) in &input.headers {
        if let (Ok(n), Ok(v)) = (HeaderName::from_bytes(name), HeaderValue::from_bytes(value)) {
            req.headers_mut().append(n, v);
        }
    }
    for (name, value) in [("x-api-key", &input.api_key), ("x-user", &input.user)] {
        if let Some(Ok(v)) = value.as_deref().map(HeaderValue::from_bytes) {
            req.headers_mut().insert(name, v);
        }
    }
    if let Some((ip, port)) = input.peer {
        req.extensions_mut().insert(SocketAddr::new(ip, port));
    }

    let api = Header::named("x-api-key").unwrap();
    let user = Header::named("x-user").unwrap();
    let api_key = run(&api, &req);
    // A header key exactly when the (first) value is present and non-empty.
    let present = req
        .headers()
        .get("x-api-key")
        .is_some_and(|v| !v.is_empty());
    assert_eq!(api_key.is_some(), present);
    assert!(run(&Path, &req).is_some());
    assert!(run(&Method, &req).is_some());
    assert!(run(&Global, &req).is_some());
    assert_eq!(run(&PeerIp::new(), &req).is_some(), input.peer.is_some());
    if let Ok(h) = Header::named(&input.configured) {
        let _ = run(&h, &req);
    }
    if let Ok(name) = HeaderName::from_bytes(input.configured.as_bytes()) {
        let _ = run(&Header::from_name(name), &req);
    }

    let _ = run(&(Path,), &req);
    let _ = run(&(api.clone(), Path), &req);
    let _ = run(&(Method, Path, user.clone()), &req);
    let _ = run(&(Global, api.clone(), Method, Path), &req);
    let chain = api.clone().or(user.clone()).or(PeerIp::new());
    let chained = run(&chain, &req);
    assert_eq!(
        chained.is_some(),
        api_key.is_some() || run(&user, &req).is_some() || input.peer.is_some()
    );
    // Branches are tagged: the API key alone never equals the chain's key.
    if let (Some(a), Some(c)) = (&api_key, &chained) {
        assert_ne!(a, c);
    }
    let _ = run(&Or::new((api.clone(), Path), (Method, Path)), &req);
    let closure = |r: &Request<()>, k: &mut KeyBuf| {
        k.push(r.uri().query()?.as_bytes());
        Some(())
    };
    let _ = run(&api.or(Path).or(Method), &req);
    let _ = run(&Or::new(closure, Global), &req);

    // KeyBuf: a failed extractor rolled back leaves the key as before.
    let split = usize::from(input.mark_at).min(input.parts.len());
    let (before, after) = input.parts.split_at(split);
    let mut key = KeyBuf::new();
    for p in before {
        key.push(p);
    }
    let mut want = key.clone();
    let want = finish(&mut want);
    let mark = key.mark();
    for p in after {
        key.push(p);
    }
    let mut whole = key.clone();
    let whole = finish(&mut whole);
    key.reset(mark);
    assert_eq!(finish(&mut key), want);
    // Length-prefixed parts: the same bytes split differently differ
    // (unless both are the same split).
    if after.len() == 1 && before.len() == 1 {
        let joined: Vec<u8> = before[0].iter().chain(&after[0]).copied().collect();
        let mut one = KeyBuf::new();
        one.push(&joined);
        assert_ne!(finish(&mut one), whole);
    }
    let _ = key.fingerprint();
});
