package bench

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// cpuClock reads the CPU time used so far by this process and by the
// database server a benchmark runs against: this process's from getrusage
// (user and system), the server's as the sum of utime and stime over its
// processes in /proc (every PostgreSQL backend and auxiliary process,
// MariaDB's one mariadbd). Over a span of messages it measures what they
// cost the machine, which moves far less than msgs/s does when the machine
// drifts: a message that costs 3 % more CPU on 2 busy cores runs about 3 %
// slower, whatever else the machine is doing.
//
// The server's times are in clock ticks (USER_HZ, 100 a second on Linux):
// take the sum over many messages. A server process that exits within the
// span takes its CPU with it, so the pools must keep their connections.
type cpuClock struct {
	server string // the server's process name in /proc/<pid>/comm; "" for none (SQLite)
}

// serverFor returns the cpuClock of the database named as databases()
// names them: PostgreSQL's, MariaDB's, or none for SQLite.
func serverFor(name string) cpuClock {
	switch {
	case strings.HasPrefix(name, "postgres"):
		return cpuClock{server: "postgres"}
	case strings.HasPrefix(name, "mysql"):
		return cpuClock{server: "mariadbd"}
	}
	return cpuClock{}
}

// now returns this process's CPU time and the server's.
func (c cpuClock) now() (process, server time.Duration) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err == nil {
		process = time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	if c.server == "" {
		return process, 0
	}
	stats, _ := filepath.Glob("/proc/[0-9]*/stat")
	var ticks int64
	for _, path := range stats {
		data, err := os.ReadFile(path)
		if err != nil {
			continue // exited meanwhile
		}
		s := string(data)
		open, end := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
		if open < 0 || end < open || s[open+1:end] != c.server {
			continue
		}
		// After "pid (comm) ": state is field 3, utime 14 and stime 15.
		f := strings.Fields(s[end+1:])
		if len(f) < 13 {
			continue
		}
		u, _ := strconv.ParseInt(f[11], 10, 64)
		st, _ := strconv.ParseInt(f[12], 10, 64)
		ticks += u + st
	}
	return process, time.Duration(ticks) * 10 * time.Millisecond
}
