package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/odpemu/odpemu/verbs"
	"github.com/stretchr/testify/require"
)

// TestRun: odpemu run builds the library and runs an unmodified verbs program on it,
// with the program's exit status.
func TestRun(t *testing.T) {
	if _, err := verbs.SystemLibrary(); err != nil {
		t.Skip(err)
	}
	if _, err := exec.LookPath("ibv_devinfo"); err != nil {
		t.Skip("needs ibv_devinfo (Debian: ibverbs-utils):", err)
	}
	dir := t.TempDir()
	bin := filepath.Join(dir, "odpemu")
	out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput()
	require.NoError(t, err, "%s", out)
	lib := filepath.Join(dir, "lib")

	cmd := exec.Command(bin, "run", "-o", lib, "--", "ibv_devinfo", "-d", "odpemu0")
	cmd.Env = append(os.Environ(), "ODPEMU_ADDR=127.0.0.3")
	out, err = cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	require.Contains(t, string(out), "hca_id:\todpemu0")
	require.FileExists(t, filepath.Join(lib, verbs.LibraryName))

	// The program's failure is odpemu's: ibv_devinfo of a device that is not there.
	err = exec.Command(bin, "run", "-o", lib, "--", "ibv_devinfo", "-d", "mlx5_0").Run()
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit)
	require.NotZero(t, exit.ExitCode())
	err = exec.Command(bin, "run", "-o", lib, "--", filepath.Join(dir, "no-such-program")).Run()
	require.ErrorAs(t, err, &exit)
	require.Equal(t, 127, exit.ExitCode())
}
