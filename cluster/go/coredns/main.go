// The cluster's DNS: CoreDNS with only the plugins its Corefile uses (cluster/configs.py: corefile).
// CoreDNS's own main links every plugin it ships (cloud DNS providers with their SDKs among them);
// this one links four, which halves what a cold build compiles.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/template"
)

func init() {
	// The order in which a server block's plugins handle a query (as CoreDNS's plugin.cfg orders them).
	dnsserver.Directives = []string{"bind", "errors", "template", "kubernetes"}
}

func main() {
	coremain.Run()
}
