package verbs

import (
	"debug/elf"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// The files Build writes into its output directory.
const (
	LibraryName = "libibverbs.so.1"    // the verbs library programs load
	BackendName = "libodpemu-verbs.so" // the emulator it loads
)

// Build builds libibverbs.so.1 and libodpemu-verbs.so into dir, for the installed
// rdma-core (SystemLibrary): the C half with gcc, its version script and stubs
// generated from the installed library, the Go half with go build -buildmode=c-shared.
// moduleDir is the odpemu module's root (ModuleDir). A program then runs on the
// emulator with LD_LIBRARY_PATH=dir. The files are replaced by rename: a program
// running on the old ones keeps them.
func Build(moduleDir, dir string) error {
	moduleDir, err := filepath.Abs(moduleDir)
	if err != nil {
		return err
	}
	if dir, err = filepath.Abs(dir); err != nil {
		return err
	}
	system, err := SystemLibrary()
	if err != nil {
		return err
	}
	abi, err := ReadABI(system)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	work, err := os.MkdirTemp("", "odpemu-verbs-build")
	if err != nil {
		return err
	}
	defer func() { _ = os.RemoveAll(work) }() // scratch files; a leftover is harmless

	sources, err := filepath.Glob(filepath.Join(moduleDir, "verbs", "libibverbs", "*.c"))
	if err != nil {
		return err
	}
	var objs []string
	defined := map[string]bool{}
	for _, src := range sources {
		obj := filepath.Join(work, strings.TrimSuffix(filepath.Base(src), ".c")+".o")
		if err := run(moduleDir, "gcc", "-c", "-O2", "-g", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wextra", "-Werror",
			"-o", obj, src); err != nil {
			return err
		}
		if err := exportedSymbols(obj, defined); err != nil {
			return err
		}
		objs = append(objs, obj)
	}
	exported := map[string]bool{}
	var names []string
	for _, s := range abi.Symbols {
		exported[s.Name] = true
		names = append(names, s.Name)
	}
	for name := range defined {
		if !exported[name] {
			return fmt.Errorf("verbs: libibverbs/*.c export %s, which %s does not", name, system)
		}
	}
	headers, err := preprocessedHeaders()
	if err != nil {
		return err
	}
	stubs := filepath.Join(work, "stubs.c")
	if err := os.WriteFile(stubs, abi.Stubs(defined, prototypeKinds(headers, names)), 0o644); err != nil {
		return err
	}
	script := filepath.Join(work, "libibverbs.map")
	if err := os.WriteFile(script, abi.VersionScript(), 0o644); err != nil {
		return err
	}
	out, err := os.MkdirTemp(dir, ".build-")
	if err != nil {
		return err
	}
	defer func() { _ = os.RemoveAll(out) }() // empty after the renames, or a failed build's
	args := append([]string{"-shared", "-O2", "-fPIC", "-fvisibility=hidden", "-o", filepath.Join(out, LibraryName)}, objs...)
	args = append(args, stubs, "-Wl,-soname,"+LibraryName, "-Wl,--version-script="+script, "-Wl,-z,now",
		"-Wl,--no-undefined", "-ldl", "-lpthread")
	if err := run(moduleDir, "gcc", args...); err != nil {
		return err
	}
	if err := run(moduleDir, "go", "build", "-buildmode=c-shared", "-o", filepath.Join(out, BackendName),
		"./verbs/emu"); err != nil {
		return err
	}
	for _, name := range []string{BackendName, LibraryName} {
		if err := os.Rename(filepath.Join(out, name), filepath.Join(dir, name)); err != nil {
			return err
		}
	}
	return nil
}

// ModuleDir returns the root of the odpemu module the go command finds from the
// working directory: Build needs its sources.
func ModuleDir() (string, error) {
	gomod, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		return "", fmt.Errorf("verbs: go env GOMOD: %w", err)
	}
	mod := strings.TrimSpace(string(gomod))
	if mod == "" || mod == os.DevNull {
		return "", fmt.Errorf("verbs: run inside the odpemu module: its sources are built")
	}
	dir := filepath.Dir(mod)
	if _, err := os.Stat(filepath.Join(dir, "verbs", "libibverbs", "verbs.c")); err != nil {
		return "", fmt.Errorf("verbs: %s is not the odpemu module: %w", dir, err)
	}
	return dir, nil
}

// exportedSymbols adds to out the global symbols of default visibility an object
// file defines.
func exportedSymbols(obj string, out map[string]bool) error {
	f, err := elf.Open(obj)
	if err != nil {
		return err
	}
	defer func() { _ = f.Close() }() // read only
	syms, err := f.Symbols()
	if err != nil {
		return err
	}
	for _, s := range syms {
		if s.Section != elf.SHN_UNDEF && elf.ST_BIND(s.Info) == elf.STB_GLOBAL &&
			elf.ST_VISIBILITY(s.Other) == elf.STV_DEFAULT {
			out[s.Name] = true
		}
	}
	return nil
}

// preprocessedHeaders is the installed verbs.h as the compiler sees it, every header
// it includes expanded.
func preprocessedHeaders() ([]byte, error) {
	cmd := exec.Command("gcc", "-E", "-P", "-x", "c", "-")
	cmd.Stdin = strings.NewReader("#include <infiniband/verbs.h>\n")
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("verbs: preprocess verbs.h: %w", err)
	}
	return out, nil
}

// run runs a build command in dir; its output is the error's text when it fails.
func run(dir, name string, args ...string) error {
	cmd := exec.Command(name, args...)
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("verbs: %s %s: %w\n%s", name, strings.Join(args, " "), err, out)
	}
	return nil
}
