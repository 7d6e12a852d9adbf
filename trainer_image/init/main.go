// tpujob-init: the worker container's PID 1 on the InPlace rung, in front of JobSet's in-place-restart
// agent (`tpujob-init in-place-restart-agent`).
//
// JobSet's agent (v0.11, v0.12) ends its worker at once (SIGKILL) when it gets SIGTERM, so a preempted or
// drained worker would lose its SIGTERM save. The runtime signals PID 1 only, so under this PID 1 the
// agent never sees SIGTERM or SIGINT: they go to every other process in the container (the worker,
// whose shell traps them and waits, see the operator's jobset.worker_command). The worker saves and
// exits, the agent exits with the worker's code, and so does this process. With no worker running (the
// agent waiting at JobSet's barrier) the signal goes to the agent, which then exits at once.
//
// As a PID 1 it reaps orphans; it is also their subreaper where it is not PID 1 (the devcluster).
package main

import (
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// How often a relayed signal is sent on to processes started since (a worker the agent was starting).
const relayRescan = time.Second

const prSetChildSubreaper = 36 // prctl(2)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: tpujob-init COMMAND [ARG...]")
		os.Exit(2)
	}
	signals := make(chan os.Signal, 4)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	if _, _, errno := syscall.RawSyscall(syscall.SYS_PRCTL, prSetChildSubreaper, 1, 0); errno != 0 {
		fmt.Fprintf(os.Stderr, "tpujob-init: cannot become a subreaper: %v\n", errno)
	}
	agent := exec.Command(os.Args[1], os.Args[2:]...)
	agent.Stdin, agent.Stdout, agent.Stderr = os.Stdin, os.Stdout, os.Stderr
	if err := agent.Start(); err != nil {
		fmt.Fprintf(os.Stderr, "tpujob-init: %v\n", err)
		os.Exit(127)
	}
	go relay(signals, agent.Process.Pid)
	os.Exit(reapUntil(agent.Process.Pid))
}

// reapUntil waits for every child (orphans included) until the agent exits; its exit code, as a
// runtime reports it (128+N when killed by signal N).
func reapUntil(agent int) int {
	for {
		var status syscall.WaitStatus
		pid, err := syscall.Wait4(-1, &status, 0, nil)
		if err == syscall.EINTR {
			continue
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, "tpujob-init: wait: %v\n", err)
			return 1
		}
		if pid != agent {
			continue
		}
		if status.Signaled() {
			return 128 + int(status.Signal())
		}
		return status.ExitStatus()
	}
}

// relay sends each signal to every process under this one but the agent (or to the agent when it has
// none), then keeps sending it, once each, to processes that appear until this process exits.
func relay(signals <-chan os.Signal, agent int) {
	sig := (<-signals).(syscall.Signal)
	sent := map[int]bool{}
	for {
		targets := descendants(os.Getpid(), agent)
		if len(targets) == 0 && len(sent) == 0 {
			targets = []int{agent}
		}
		for _, pid := range targets {
			if !sent[pid] {
				sent[pid] = true
				_ = syscall.Kill(pid, sig)
			}
		}
		select {
		case next := <-signals:
			sig, sent = next.(syscall.Signal), map[int]bool{}
		case <-time.After(relayRescan):
		}
	}
}

// descendants lists the processes under root, from /proc, leaving out the agent itself.
func descendants(root, agent int) []int {
	parents := map[int]int{}
	entries, _ := filepath.Glob("/proc/[0-9]*/stat")
	for _, path := range entries {
		pid, ppid, ok := readStat(path)
		if ok {
			parents[pid] = ppid
		}
	}
	var found []int
	for pid := range parents {
		if pid != agent && pid != root && under(pid, root, parents) {
			found = append(found, pid)
		}
	}
	return found
}

func under(pid, root int, parents map[int]int) bool {
	for seen := 0; pid > 1 && seen < len(parents); seen++ {
		pid = parents[pid]
		if pid == root {
			return true
		}
	}
	return false
}

// readStat parses pid and ppid from /proc/PID/stat ("pid (comm) state ppid ..."; comm may hold spaces
// and parentheses, so the fields after it are found from its last ')').
func readStat(path string) (int, int, bool) {
	data, err := os.ReadFile(path)
	if err != nil {
		return 0, 0, false
	}
	text := string(data)
	open, closing := strings.IndexByte(text, ' '), strings.LastIndexByte(text, ')')
	if open < 0 || closing < 0 {
		return 0, 0, false
	}
	fields := strings.Fields(text[closing+1:])
	if len(fields) < 2 {
		return 0, 0, false
	}
	pid, err1 := strconv.Atoi(text[:open])
	ppid, err2 := strconv.Atoi(fields[1])
	return pid, ppid, err1 == nil && err2 == nil
}
