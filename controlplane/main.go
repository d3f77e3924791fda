// Command controlplane is one binary that runs a component of a Kubernetes control
// plane: etcd, kube-apiserver, kube-scheduler or kube-controller-manager, all built
// from their upstream Go modules at the versions pinned in go.mod.
//
// The component is chosen by the name the binary was called by (a symlink named
// kube-apiserver, etcd, ...) or, failing that, by the first argument:
//
//	controlplane etcd --data-dir ...
//	controlplane kube-apiserver --etcd-servers ...
//
// Each invocation runs exactly one component; run each in its own process (logging
// configuration, signal handling and feature gates are process-global).
package main

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"go.etcd.io/etcd/server/v3/etcdmain"
	"k8s.io/component-base/cli"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
)

// components maps a component name to a function that runs it with the given
// arguments (without the component name) and returns the process exit code.
var components = map[string]func(args []string) int{
	"etcd": func(args []string) int {
		// etcdmain.Main reads its flags from its argument slice, which starts
		// with the program name, and exits the process itself on error.
		etcdmain.Main(append([]string{"etcd"}, args...))
		return 0
	},
	"kube-apiserver": func(args []string) int {
		cmd := apiserver.NewAPIServerCommand()
		cmd.SetArgs(args)
		return cli.Run(cmd)
	},
	"kube-controller-manager": func(args []string) int {
		cmd := controllermanager.NewControllerManagerCommand()
		cmd.SetArgs(args)
		return cli.Run(cmd)
	},
	"kube-scheduler": func(args []string) int {
		cmd := scheduler.NewSchedulerCommand()
		cmd.SetArgs(args)
		return cli.Run(cmd)
	},
}

func names() string {
	list := make([]string, 0, len(components))
	for name := range components {
		list = append(list, name)
	}
	sort.Strings(list)
	return strings.Join(list, ", ")
}

func usage() {
	fmt.Fprintf(os.Stderr, "usage: %s COMPONENT [flags...]\n  components: %s\n"+
		"  or call this binary through a link named after a component\n",
		filepath.Base(os.Args[0]), names())
}

func main() {
	if run, ok := components[filepath.Base(os.Args[0])]; ok {
		os.Exit(run(os.Args[1:]))
	}
	if len(os.Args) < 2 {
		usage()
		os.Exit(2)
	}
	switch os.Args[1] {
	case "-h", "--help", "help":
		usage()
		os.Exit(0)
	}
	run, ok := components[os.Args[1]]
	if !ok {
		fmt.Fprintf(os.Stderr, "controlplane: unknown component %q\n", os.Args[1])
		usage()
		os.Exit(2)
	}
	// Present the component's own name as argv[0] (help texts and logs use it).
	os.Args = append([]string{os.Args[1]}, os.Args[2:]...)
	os.Exit(run(os.Args[1:]))
}
