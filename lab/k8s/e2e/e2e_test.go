// Package e2e is the lab's build of the upstream Kubernetes e2e suite, cut down to the
// network tests: `go test -c` of this package gives an e2e.test that runs exactly the
// specs of k8s.io/kubernetes/test/e2e/network at the pinned release, with the upstream
// framework, flags (--kubeconfig, --provider, --ginkgo.focus, --report-dir ...) and images.
//
// Only the suite setup is ours. It is the part of test/e2e/e2e.go a network run needs:
// the test files the specs read, and the cluster's default IP family, which the network
// specs use to pick Service and pod addresses. Importing test/e2e itself would compile
// every SIG's tests (storage, apps, ...) for nothing.
package e2e

import (
	"context"
	"flag"
	"fmt"
	"os"
	"testing"

	"github.com/onsi/ginkgo/v2"
	"github.com/onsi/gomega"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/component-base/logs"
	"k8s.io/component-base/version"
	"k8s.io/klog/v2"
	utilnet "k8s.io/utils/net"

	"k8s.io/kubernetes/test/e2e/framework"
	"k8s.io/kubernetes/test/e2e/framework/config"
	"k8s.io/kubernetes/test/e2e/framework/testfiles"
	e2etestingmanifests "k8s.io/kubernetes/test/e2e/testing-manifests"

	// The tests.
	_ "k8s.io/kubernetes/test/e2e/network"

	// As the upstream suite: dump the namespace's events and pods on failure, and check
	// after each test that every node is still Ready.
	_ "k8s.io/kubernetes/test/e2e/framework/debug/init"
	_ "k8s.io/kubernetes/test/e2e/framework/node/init"
	_ "k8s.io/kubernetes/test/utils/ktesting/format"
)

func TestMain(m *testing.M) {
	showVersion := flag.Bool("version", false, "print the Kubernetes version the suite was built from")
	config.CopyFlags(config.Flags, flag.CommandLine)
	framework.RegisterCommonFlags(flag.CommandLine)
	framework.RegisterClusterFlags(flag.CommandLine)
	flag.Parse()
	if *showVersion {
		fmt.Println(version.Get())
		os.Exit(0)
	}
	if flag.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "unknown arguments: %v\n", flag.Args())
		os.Exit(2)
	}
	testfiles.AddFileSource(e2etestingmanifests.GetE2ETestingManifestsFS())
	framework.AfterReadingAllFlags(&framework.TestContext)
	os.Exit(m.Run())
}

// Every Ginkgo process: the cluster's primary IP family, from the kubernetes Service
// (as upstream's setupSuitePerGinkgoNode does).
var _ = ginkgo.SynchronizedBeforeSuite(func(ctx context.Context) []byte { return nil },
	func(ctx context.Context, _ []byte) {
		c, err := framework.LoadClientset()
		framework.ExpectNoError(err, "loading the client")
		svc, err := c.CoreV1().Services(metav1.NamespaceDefault).Get(ctx, "kubernetes", metav1.GetOptions{})
		framework.ExpectNoError(err, "reading the kubernetes Service")
		framework.TestContext.IPFamily = "ipv4"
		if utilnet.IsIPv6String(svc.Spec.ClusterIP) {
			framework.TestContext.IPFamily = "ipv6"
		}
	})

func TestE2E(t *testing.T) {
	logs.InitLogs()
	defer logs.FlushLogs()
	klog.EnableContextualLogging(true)
	gomega.RegisterFailHandler(framework.Fail)
	suiteConfig, reporterConfig := framework.CreateGinkgoConfig()
	ginkgo.RunSpecs(t, "kxlb lab: upstream network e2e", suiteConfig, reporterConfig)
}
