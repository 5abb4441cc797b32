// Command odpemu runs unmodified verbs programs on odpemu's emulated ODP NIC:
//
//	odpemu run -- ib_write_bw --odp                                  # a server, on 127.0.0.1
//	ODPEMU_ADDR=127.0.0.2 odpemu run -- ib_write_bw --odp 127.0.0.1  # its client
//
// run builds odpemu's libibverbs.so.1 and the emulator (package verbs) into a cache
// directory if they changed, then runs the program with them first on
// LD_LIBRARY_PATH; its exit status is odpemu's. build only builds, into -o DIR. Run
// it inside the odpemu module (go run ./cmd/odpemu ...): the build needs its sources,
// the installed rdma-core's library and headers, and gcc.
//
// The program's environment sets the device: ODPEMU_ADDR is the IPv4 address its port
// is bound to (GID index 0; default 127.0.0.1; two processes on one host need two
// addresses), ODPEMU_PROFILE names the device's profile (odp.Profiles: connectx4, rxe,
// ...; default the emulator's own costs), ODPEMU_NO_SNAPSHOT=1 maps no page at ODP
// registration, ODPEMU_GSO=1 sends runs of packets with UDP segmentation offload
// (faster between odpemu processes; captures then show the unsegmented datagrams).
package main

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"syscall"

	"github.com/odpemu/odpemu/verbs"
)

func usage() {
	fmt.Fprintln(os.Stderr, "usage: odpemu run [-o DIR] -- PROGRAM [ARGS...]\n       odpemu build -o DIR")
	os.Exit(2)
}

func main() {
	if len(os.Args) < 2 {
		usage()
	}
	fs := flag.NewFlagSet(os.Args[1], flag.ExitOnError)
	out := fs.String("o", "", "the directory to build into (run: a cache directory by default)")
	if err := fs.Parse(os.Args[2:]); err != nil {
		usage()
	}
	switch os.Args[1] {
	case "build":
		if *out == "" || fs.NArg() > 0 {
			usage()
		}
		if err := build(*out); err != nil {
			fail(err)
		}
		fmt.Printf("built %s and %s in %s\n", verbs.LibraryName, verbs.BackendName, *out)
	case "run":
		if fs.NArg() == 0 {
			usage()
		}
		dir := *out
		if dir == "" {
			cache, err := os.UserCacheDir()
			if err != nil {
				fail(err)
			}
			dir = filepath.Join(cache, "odpemu", "verbs")
		}
		if err := build(dir); err != nil {
			fail(err)
		}
		os.Exit(run(dir, fs.Args()))
	default:
		usage()
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "odpemu:", err)
	os.Exit(1)
}

// build builds the library into dir; the go command's and gcc's work is quick when
// nothing changed.
func build(dir string) error {
	mod, err := verbs.ModuleDir()
	if err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	return verbs.Build(mod, dir)
}

// run runs the program with the library from dir and returns its exit status. The
// interrupts a terminal sends reach the program, which decides what they mean.
func run(dir string, argv []string) int {
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	ld := dir
	if old := os.Getenv("LD_LIBRARY_PATH"); old != "" {
		ld += ":" + old
	}
	cmd.Env = append(os.Environ(), "LD_LIBRARY_PATH="+ld)
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP)
	if err := cmd.Start(); err != nil {
		fmt.Fprintln(os.Stderr, "odpemu:", err)
		return 127
	}
	go func() {
		for s := range sigs {
			_ = cmd.Process.Signal(s) // it may have exited meanwhile
		}
	}()
	err := cmd.Wait()
	signal.Stop(sigs)
	var exit *exec.ExitError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &exit):
		if ws, ok := exit.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			return 128 + int(ws.Signal())
		}
		return exit.ExitCode()
	default:
		fmt.Fprintln(os.Stderr, "odpemu:", err)
		return 1
	}
}
