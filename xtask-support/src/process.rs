//! Running child programs (cargo, pip, cmake) with their output streamed through and failures turned into one line.

use std::ffi::OsString;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, ExitCode, ExitStatus};

use crate::Failure;

/// The cargo that runs xtask (`$CARGO`), so nested builds use the same toolchain.
pub fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| OsString::from("cargo")))
}

/// Runs `command` to completion with inherited stdio; blocks until it exits.
pub fn status(command: &mut Command) -> Result<ExitStatus, Failure> {
    command.status().map_err(|err| {
        Failure::new(
            format!("cannot start `{}`: {err}", describe(command)),
            "check that it is installed and on PATH",
        )
    })
}

/// Runs `command` and fails with `todo` unless it exits 0.
pub fn run(command: &mut Command, todo: &str) -> Result<(), Failure> {
    let status = status(command)?;
    if status.success() {
        Ok(())
    } else {
        Err(Failure::new(
            format!(
                "`{}` failed ({})",
                describe(command),
                describe_status(status)
            ),
            todo,
        ))
    }
}

/// The command line as a user would type it (program by name, not path), for messages.
pub fn describe(command: &Command) -> String {
    let program = command.get_program();
    std::iter::once(Path::new(program).file_name().unwrap_or(program))
        .chain(command.get_args())
        .map(|part| part.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

pub fn describe_status(status: ExitStatus) -> String {
    match (status.code(), signal_name(status), status.signal()) {
        (Some(code), _, _) => format!("exit status {code}"),
        (None, Some(name), _) => format!("killed by {name}"),
        (None, None, Some(signal)) => format!("killed by signal {signal}"),
        (None, None, None) => "unknown exit status".to_owned(),
    }
}

/// How a program ended, as serve words a backend's end: "exited with status 1", "was killed by SIGSEGV".
pub fn how_it_ended(status: ExitStatus) -> String {
    match status.code() {
        Some(code) => format!("exited with status {code}"),
        None => format!("was {}", describe_status(status)),
    }
}

/// The name of the signal that killed it (`SIGSEGV`), if one did.
pub fn signal_name(status: ExitStatus) -> Option<&'static str> {
    let signal = nix::sys::signal::Signal::try_from(status.signal()?).ok()?;
    Some(signal.as_str())
}

/// The exit code that passes a child's status on: its code, or 128 + the signal that killed it.
pub fn exit_code(status: ExitStatus) -> ExitCode {
    match (status.code(), status.signal()) {
        (Some(code), _) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        (None, Some(signal)) => ExitCode::from(u8::try_from(128 + signal).unwrap_or(1)),
        (None, None) => ExitCode::FAILURE,
    }
}
