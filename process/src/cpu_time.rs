//! The CPU time a process has used, from `/proc/PID/stat` (Linux): serve's start judges by it
//! how long a backend has had to bind its port, which the clock cannot tell on a starved
//! machine.

use std::time::Duration;

/// The CPU time (user and system) process `pid` has used, its own threads' and not its
/// children's; None once it is gone (or `/proc` cannot be read).
pub fn cpu_time(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    cpu_time_of_stat(&stat)
}

/// utime + stime (fields 14 and 15, in clock ticks) of a `/proc/PID/stat` line; the command
/// name in parentheses may hold spaces, so fields are counted after its closing one.
fn cpu_time_of_stat(stat: &str) -> Option<Duration> {
    let after_name = &stat[stat.rfind(')')? + 1..];
    let mut fields = after_name.split_whitespace().skip(11);
    let ticks: u64 = fields.next()?.parse::<u64>().ok()? + fields.next()?.parse::<u64>().ok()?;
    Some(Duration::from_millis(
        ticks * 1000 / crate::sys::clock_ticks_per_second(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_time_is_read_after_a_command_name_with_spaces_and_parentheses() {
        // pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt
        // utime stime ...
        let stat = "42 (llama server (x)) S 1 42 42 0 -1 4194560 100 0 0 0 150 50 0 0 20 0 4 0";
        let ticks = crate::sys::clock_ticks_per_second();
        assert_eq!(
            cpu_time_of_stat(stat),
            Some(Duration::from_millis(200 * 1000 / ticks))
        );
        assert_eq!(cpu_time_of_stat("42 (cut"), None);
        assert_eq!(cpu_time_of_stat("42 (x) S 1 2"), None);
    }

    #[test]
    fn this_process_has_a_cpu_time_and_a_gone_one_has_none() {
        let spent = std::time::Instant::now();
        while spent.elapsed() < Duration::from_millis(60) {
            std::hint::black_box(0u64);
        }
        let mine = cpu_time(std::process::id());
        assert!(
            mine.is_some_and(|t| t >= Duration::from_millis(30)),
            "{mine:?}"
        );
        assert_eq!(cpu_time(u32::MAX), None);
    }
}
