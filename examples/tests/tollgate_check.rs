//! `tollgate-check`: what a policy file declares, or its first problem
//! (issue 32: a file is checked before it is deployed).
#![allow(missing_docs, clippy::unwrap_used)]

use std::process::Command;

#[test]
fn tollgate_check_lists_every_limit_or_names_the_problem() {
    let quickstart = concat!(env!("CARGO_MANIFEST_DIR"), "/quickstart.toml");
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate-check"))
        .arg(quickstart)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    for line in [
        "rule \"per-key\": key header:x-api-key | client-ip; gcra 10/s, burst 20; cost api; plans pro",
        "quota \"daily\": key header:x-api-key | client-ip; 1000 a day; cost api; plans pro",
        "in flight \"per-client\": key header:x-api-key | client-ip; at most 64 per key; service \"service\" adaptive (gradient) from 16 to 512, starting at 64",
        "bandwidth \"download-rate\": key header:x-api-key | client-ip; 256 KiB/s, bursts of 64 KiB; responses; on GET /api/download",
    ] {
        assert!(stdout.lines().any(|l| l == line), "{line:?} not in:\n{stdout}");
    }
    assert_eq!(stdout.lines().count(), 11, "{stdout}");
    // A bad file: its first problem, at its line, and status 2.
    let dir = std::env::temp_dir().join(format!("tollgate-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.toml");
    std::fs::write(
        &bad,
        "[[rules]]\nname = \"a\"\nkey = \"global\"\nrate = \"1/s\"\nburst = 1\n\n[[bandwidth]]\nname = \"b\"\nkey = \"global\"\nrate = \"1 parsec/s\"\nburst = 1\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate-check"))
        .arg(&bad)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(":10:8: bandwidth[0].rate: is not a number of bytes like \"256 KiB/s\""),
        "{stderr}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
