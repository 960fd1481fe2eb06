//! `tollgate-check policy.toml`: loads a policy file as a server would
//! (every section built on a throwaway store), and prints what it
//! declares, one line per limit; or the first problem, with its line,
//! column and field, and exits with status 2.
//!
//! ```sh
//! cargo run -p tollgate-examples --bin tollgate-check -- examples/quickstart.toml
//! ```

use std::process::ExitCode;

use tollgate::config::PolicyFile;

fn main() -> ExitCode {
    let Some(path) = std::env::args_os().nth(1) else {
        eprintln!("usage: tollgate-check <policy.toml>");
        return ExitCode::from(2);
    };
    match PolicyFile::read(&path) {
        Ok(file) => {
            for line in file.describe() {
                println!("{line}");
            }
            println!("{}: ok", std::path::Path::new(&path).display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::from(2)
        }
    }
}
