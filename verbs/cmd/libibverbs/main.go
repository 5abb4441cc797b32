// Command libibverbs builds odpemu's libibverbs.so.1 and the emulator it loads into a
// directory, for the installed rdma-core:
//
//	go run ./verbs/cmd/libibverbs -o /tmp/odpemu-verbs
//	LD_LIBRARY_PATH=/tmp/odpemu-verbs ibv_devinfo -v
//
// ODPEMU_ADDR sets the IPv4 address the device is bound to (its GID; default
// 127.0.0.1). Run it from the odpemu module.
package main

import (
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/odpemu/odpemu/verbs"
)

func main() {
	out := flag.String("o", "", "the directory to build into (required)")
	flag.Parse()
	if *out == "" || flag.NArg() > 0 {
		flag.Usage()
		os.Exit(2)
	}
	if err := build(*out); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

func build(out string) error {
	gomod, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		return fmt.Errorf("go env GOMOD: %w", err)
	}
	mod := strings.TrimSpace(string(gomod))
	if mod == "" || mod == os.DevNull {
		return fmt.Errorf("run it inside the odpemu module")
	}
	dir, err := filepath.Abs(out)
	if err != nil {
		return err
	}
	if err := verbs.Build(filepath.Dir(mod), dir); err != nil {
		return err
	}
	fmt.Printf("built %s and %s in %s\nrun a verbs program on odpemu: LD_LIBRARY_PATH=%s ibv_devinfo -v\n",
		verbs.LibraryName, verbs.BackendName, dir, dir)
	return nil
}
