//! What Linux's `/proc` says of a process: the demo's idle CPU figure and the attacker's check
//! that P is alive both read `/proc/PID/stat`.

/// The fields of `/proc/PID/stat` after the command name, the state (`R`, `S`, `Z`, ...) first,
/// so that utime and stime are at 11 and 12; `None` if the process is gone.
pub fn stat(pid: u32) -> Option<Vec<String>> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may hold spaces or parentheses itself.
    let (_, rest) = text.rsplit_once(')')?;
    Some(rest.split_whitespace().map(str::to_owned).collect())
}

#[cfg(test)]
mod tests {
    #[test]
    fn this_process_is_running_and_has_cpu_times() {
        let fields = super::stat(std::process::id()).expect("our own stat");
        assert!(fields[0] != "Z", "{fields:?}");
        assert!(fields[11].parse::<u64>().is_ok() && fields[12].parse::<u64>().is_ok(), "{fields:?}");
        assert!(super::stat(u32::MAX).is_none());
    }
}
